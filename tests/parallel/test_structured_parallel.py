"""Structured outputs in a TP=2 engine group on the CPU: the same tokens as one process, and valid.

The model is a random Llama with SmolLM2's tokenizer (4 heads, 2 KV heads: TP=2 divides them; SmolLM2
itself has 9 heads). One batch mixes a choice, a regex, a JSON schema and an unconstrained row, so the
grammar masks of some rows and the free sampling of others share every window.
"""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

CHOICES = ["yes", "no", "maybe not"]
PHONE = r"\d{3}-\d{4}"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
PROMPTS = ["Is the sky blue?", "Call me at", "A city and a number:", "Once upon a time"]

# One process per layout; N=1 shares the N=8 engine's model (and, at TP=2, its group).
SCRIPT = r"""
import json, os, sys
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
path, tp, prompts, specs = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:5])
if not os.path.exists(os.path.join(path, "tokenizer.json")):  # the first run adds SmolLM2's tokenizer
    from lockstep_engine.sources import _cached_gguf_tokenizer, fetch_smollm2
    _cached_gguf_tokenizer(fetch_smollm2()).save_pretrained(path)
engines = {8: LLM(path, tensor_parallel_size=tp, num_scheduler_steps=8, kv_cache_memory_bytes=64 << 20,
                  max_model_len=256)}
engines[1] = LLM(path, share_model_with=engines[8], tensor_parallel_size=tp, num_scheduler_steps=1,
                 kv_cache_memory_bytes=64 << 20, max_model_len=256)
seeded = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, guided=spec) for i, spec in enumerate(specs)]
greedy = [SamplingParams(temperature=0, max_tokens=24, guided=spec) for spec in specs]
result = {f"{kind} N={steps}": [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                for o in llm.generate(prompts, params)]
          for steps, llm in engines.items() for kind, params in (("seeded", seeded), ("greedy", greedy))}
print(json.dumps(result), flush=True)
"""
SPECS = [{"choice": CHOICES}, {"regex": PHONE}, {"json": SCHEMA}, None]


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> str:
    """A 2-layer random Llama directory with SmolLM2's vocabulary (the first `_run` adds its tokenizer)."""
    import torch
    from safetensors.torch import save_file

    from lockstep_engine.model_config import ModelConfig
    from lockstep_engine.sources import _weight_names

    path = tmp_path_factory.mktemp("random-llama")
    hf = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(hf))
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) * 0.02
               for name, shape in _weight_names(ModelConfig.from_hf_dict(hf))}
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


def _run(path: str, tp: int) -> dict:
    env = dict(os.environ, LOCKSTEP_CPU_THREADS="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT, path, str(tp), json.dumps(PROMPTS), json.dumps(SPECS)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_valid(rows) -> None:
    (choice, _, choice_end), (phone, _, phone_end), (city, _, city_end), (_, free_tokens, _) = rows
    assert choice in CHOICES and choice_end == "stop"
    assert re.fullmatch(PHONE, phone) and phone_end == "stop"
    jsonschema.validate(json.loads(city), SCHEMA)
    assert city_end == "stop"
    assert len(free_tokens) > 0


def test_tp2_structured_outputs_equal_one_process_and_are_valid(random_llama):
    """At N=8 and N=1, seeded and greedy."""
    single = _run(random_llama, 1)
    group = _run(random_llama, 2)
    assert len(single) == 4
    for name, rows in single.items():
        _check_valid(rows)
        assert group[name] == rows, name
