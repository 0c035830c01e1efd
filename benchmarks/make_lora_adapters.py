"""Write seeded random PEFT LoRA adapters for any model source the engine resolves, for benchmarks.

    python benchmarks/make_lora_adapters.py --model random:llama-3-8b --rank 16 --count 4 --targets all \\
        --out /tmp/adapters [--seed 0] [--alpha 32] [--prefix lora]

Each adapter is a directory `OUT/<prefix><j>` in PEFT's layout: `adapter_config.json` (r, lora_alpha,
target_modules, bias "none", peft_type "LORA", task_type, base_model_name_or_path) and
`adapter_model.safetensors` with `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`,
A [r, in] and B [out, r] in the base model's full (unsharded) shapes, float32. A is drawn like PEFT's
Kaiming-uniform start; B, which PEFT starts at zero, is drawn small (`--b-scale`, default 0.01) so the
adapter changes the output yet keeps it sane. Adapter j of seed s is the same on every run.

The shapes come from the engine's own resolution of the source (`lockstep_engine.sources.resolve`),
which reads the architecture only: `random:<shape>` is a table entry, a GGUF file's header is read,
a Hugging Face directory's config.json; no weight is loaded.

Prints the `--lora-modules` argument line (`name=path ...`) on stdout, for `lockstep serve`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

from lockstep_engine.lora.adapters import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shapes
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.sources import ModelSourceError, resolve

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_targets(text: str) -> list[str]:
    """`all` (the seven), `attention` (q, k, v, o), or a comma-separated list of module names."""
    if text == "all":
        return list(TARGET_MODULES)
    if text == "attention":
        return list(ATTENTION_TARGETS)
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown or not targets:
        raise argparse.ArgumentTypeError(
            f"unknown target module(s) {unknown or text!r}: expected all, attention, or some of {list(TARGET_MODULES)}"
        )
    return targets


def adapter_tensors(config: ModelConfig, rank: int, targets: list[str], seed: int, b_scale: float) -> dict:
    """The adapter's tensors under PEFT's names, drawn from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            bound = 1.0 / math.sqrt(fan_in)
            a = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
            b = torch.randn(fan_out, rank, generator=generator) * b_scale
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def write_adapter(path: str, source: str, config: ModelConfig, rank: int, alpha: float, targets: list[str],
                  seed: int, b_scale: float) -> None:
    os.makedirs(path, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": source,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
        f.write("\n")
    tensors = adapter_tensors(config, rank, targets, seed, b_scale)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="the base model's source, as `lockstep serve` takes it")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 x rank)")
    parser.add_argument("--count", type=int, default=4, help="how many adapters")
    parser.add_argument("--targets", type=parse_targets, default="all",
                        help="all, attention, or a comma-separated list such as q_proj,v_proj")
    parser.add_argument("--out", required=True, help="directory to write the adapters into")
    parser.add_argument("--prefix", default="lora", help="adapter j is named <prefix><j>")
    parser.add_argument("--seed", type=int, default=0, help="adapter j draws from seed + j")
    parser.add_argument("--b-scale", type=float, default=0.01, help="standard deviation of lora_B's entries")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    targets = args.targets
    if args.rank < 1:
        parser.error(f"--rank must be >= 1, got {args.rank}")
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    try:
        config = resolve(args.model).config
    except ModelSourceError as exc:
        parser.error(str(exc))
    alpha = args.alpha if args.alpha is not None else 2.0 * args.rank
    modules = []
    for j in range(args.count):
        name = f"{args.prefix}{j}"
        path = os.path.abspath(os.path.join(args.out, name))
        write_adapter(path, args.model, config, args.rank, alpha, targets, args.seed + j, args.b_scale)
        modules.append(f"{name}={path}")
        print(f"make_lora_adapters: wrote {path} (rank {args.rank}, {', '.join(targets)})", file=sys.stderr)
    print(" ".join(modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
