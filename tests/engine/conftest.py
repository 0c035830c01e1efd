"""Shared engines for the engine tests: loading SmolLM2 takes seconds, so it happens once."""

import os

import pytest
import torch

from lockstep_engine.llm import LLM
from lockstep_engine.sources import SMOLLM2_GGUF, fetch_smollm2

torch.set_num_threads(int(os.environ.get("LOCKSTEP_CPU_THREADS", "1")))


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM("smollm2", num_scheduler_steps=1, kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def make_llm(smollm2):
    """Engines with other settings over the same loaded weights."""

    def make(**kwargs) -> LLM:
        return LLM("smollm2", share_model_with=smollm2, **{"kv_cache_memory_bytes": 512 << 20, **kwargs})

    return make


@pytest.fixture(scope="session")
def tiny() -> LLM:
    return LLM("random:tiny", num_scheduler_steps=8, num_gpu_blocks_override=256, max_num_seqs=64)


class Reference:
    """Hugging Face transformers on the same GGUF: the correctness reference."""

    def __init__(self):
        from transformers import AutoModelForCausalLM

        path = fetch_smollm2()
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=SMOLLM2_GGUF,
                                                          dtype=torch.float32)
        self.model.eval()
        self._cache = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[list[float]]]:
        """Greedy tokens (stopping at EOS like generate) and the full log-softmax at each step."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, pad_token_id=2)
            tokens = out.sequences[0, len(prompt_ids):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
            self._cache[key] = (tokens, logprobs)
        return self._cache[key]


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
