"""`lockstep generate MODEL --prompt TEXT`: one generation with the offline engine, printed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from lockstep_common.argparsing import ArgumentParser
from lockstep_engine.config import ConfigError, num_scheduler_steps_arg


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lockstep generate", description=__doc__)
    parser.add_argument("model", help="smollm2, random:<shape>, a .gguf file or a Hugging Face directory")
    parser.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--num-scheduler-steps", type=num_scheduler_steps_arg, default=8)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from lockstep_engine.llm import LLM
    from lockstep_engine.sampling_params import SamplingParams
    from lockstep_engine.sources import ModelSourceError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        llm = LLM(args.model, num_scheduler_steps=args.num_scheduler_steps, max_model_len=args.max_model_len,
                  device=args.device, dtype=args.dtype)
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            output = llm.generate(args.prompt, params)[0]
    except (ConfigError, ModelSourceError, ValueError) as error:
        print(f"lockstep generate: error: {error}", file=sys.stderr)
        return 1
    completion = output.outputs[0]
    if args.json:
        print(json.dumps({"model": args.model, "prompt": args.prompt, "text": completion.text,
                          "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                          "prompt_tokens": len(output.prompt_token_ids),
                          "completion_tokens": len(completion.token_ids)}))
    else:
        print(completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
