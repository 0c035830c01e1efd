"""Synthetic benchmark workloads: request lengths, prompt token ids and arrival times.

Pure standard library (no numpy, no torch) so the gateway image can load-test too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# ShareGPT benchmark filter, as vLLM's `sample_sharegpt_requests` / `is_valid_sequence` apply it.
MIN_PROMPT_LEN = 4
MIN_OUTPUT_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# Lognormal (mu, sigma) of the raw lengths, before the filter. Calibrated offline by fixed-point
# iteration on mu over 200k accepted samples, so the accepted population means are 225.0 prompt and
# 200.0 output tokens. Achieved for seed 0, 1000 prompts: mean prompt 228.0 (max 1015), mean output
# 202.0 (median 120, max 1765).
PROMPT_LEN_MU, PROMPT_LEN_SIGMA = 5.1125, 1.0
OUTPUT_LEN_MU, OUTPUT_LEN_SIGMA = 4.7728, 1.1

# Ids below this are left out: tokenizers put their special and control tokens at the bottom.
DEFAULT_MIN_TOKEN_ID = 1000
# The smallest vocabulary among the models Lockstep serves (Llama-2 style 32k).
DEFAULT_VOCAB_SIZE = 32000

WORKLOADS = ("sharegpt-synth",)


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def is_valid_sequence(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter: both at least 4 tokens, prompt <= 1024, prompt + output <= 2048."""
    return (
        prompt_len >= MIN_PROMPT_LEN
        and output_len >= MIN_OUTPUT_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def sample_lengths(num_prompts: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs, resampled until each passes the ShareGPT filter.

    The first k pairs for a seed are the same whatever num_prompts is, as with vLLM's sampler.
    """
    rng = random.Random(seed)
    lengths: list[tuple[int, int]] = []
    while len(lengths) < num_prompts:
        prompt_len = round(rng.lognormvariate(PROMPT_LEN_MU, PROMPT_LEN_SIGMA))
        output_len = round(rng.lognormvariate(OUTPUT_LEN_MU, OUTPUT_LEN_SIGMA))
        if is_valid_sequence(prompt_len, output_len):
            lengths.append((prompt_len, output_len))
    return lengths


def sharegpt_synth(
    num_prompts: int = 1000,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_token_id: int = DEFAULT_MIN_TOKEN_ID,
) -> list[WorkloadRequest]:
    """The `sharegpt-synth` workload: ShareGPT-shaped lengths, uniform random prompt token ids.

    Deterministic for a seed. Token ids are drawn from [min_token_id, vocab_size) by a generator
    of their own, so the lengths do not depend on the vocabulary size.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if vocab_size <= min_token_id:
        raise ValueError(f"vocab_size must be > min_token_id ({min_token_id}), got {vocab_size}")
    token_ids = range(min_token_id, vocab_size)
    token_rng = random.Random(f"sharegpt-synth-tokens-{seed}")
    return [
        WorkloadRequest(prompt_token_ids=token_rng.choices(token_ids, k=prompt_len), output_len=output_len)
        for prompt_len, output_len in sample_lengths(num_prompts, seed)
    ]


def make_workload(
    name: str, num_prompts: int, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[WorkloadRequest]:
    """Look a workload up by its CLI name."""
    if name != "sharegpt-synth":
        raise ValueError(f"unknown workload {name!r}; expected one of {list(WORKLOADS)}")
    return sharegpt_synth(num_prompts=num_prompts, seed=seed, vocab_size=vocab_size)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Delays in seconds before each of n requests: a Poisson process of `rate` requests/s.

    The first request goes at once (delay 0), as in vLLM's request generator; rate=inf sends all at once.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if n < 1:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def describe(requests: list[WorkloadRequest]) -> dict[str, float | int]:
    """Counts, means and maxima of a workload's lengths."""
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    num_requests = len(requests)
    return {
        "num_requests": num_requests,
        "total_prompt_tokens": sum(prompt_lens),
        "total_output_tokens": sum(output_lens),
        "mean_prompt_len": sum(prompt_lens) / num_requests if num_requests else 0.0,
        "mean_output_len": sum(output_lens) / num_requests if num_requests else 0.0,
        "max_prompt_len": max(prompt_lens, default=0),
        "max_output_len": max(output_lens, default=0),
    }
