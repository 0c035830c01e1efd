"""`lockstep fetch MODEL`: put a model source in the local cache before serving it (e.g. smollm2)."""

from __future__ import annotations

import sys

from lockstep_common.argparsing import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="lockstep fetch", description=__doc__)
    parser.add_argument("model", help="smollm2 (downloaded once into ~/.cache/lockstep), or any source to check")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from lockstep_engine.sources import ModelSourceError, fetch_smollm2, resolve

    try:
        if args.model == "smollm2":
            print(fetch_smollm2())
        else:
            source = resolve(args.model)
            print(f"{source.spec}: {source.config.num_parameters / 1e6:.0f}M parameters, "
                  f"tokenizer: {'yes' if source.load_tokenizer else 'no'}")
    except ModelSourceError as error:
        print(f"lockstep fetch: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
