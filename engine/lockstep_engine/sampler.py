"""Sampling on the device, with no host sync: greedy, temperature, top-k/top-p/min-p, penalties,
logit bias, min_tokens, bad words, logprobs.

Random draws are counter-based: the noise for a token is a hash of (row seed, output index, token
id), so a seeded request gets the same tokens whatever its batch, window length or preemptions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
ANY_TOKEN = -2  # in a bad word's right-aligned prefix: the place before a shorter word's first token


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request (n > 1 samples differ)."""
    return _signed(seed * 0x2545F4914F6CDD1D + index * _STEP + 0x1234567)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] from (seed, step, token) alone."""
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = _splitmix(_splitmix(seeds.unsqueeze(1) + steps.unsqueeze(1) * _STEP) + tokens.unsqueeze(0))
    uniform = (_shr(x, 11).to(torch.float64) + 0.5) * (2.0 ** -53)
    return (-torch.log(uniform)).to(torch.float32)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one window, on the device. Rows are the window's sampling rows."""

    temperature: torch.Tensor  # [rows] float32, 0 for greedy
    top_k: torch.Tensor  # [rows] int64, vocab size when off
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32
    seeds: torch.Tensor  # [rows] int64
    stop_ids: torch.Tensor  # [rows, S] int64, -1 padded: EOS (unless ignore_eos) and stop_token_ids
    min_tokens: torch.Tensor  # [rows] int64
    presence: torch.Tensor | None  # [rows] float32, only when some row has penalties
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    prompt_mask: torch.Tensor | None  # [rows, vocab] bool: token occurs in the prompt
    logit_bias: torch.Tensor | None  # [rows, vocab] float32
    all_greedy: bool
    any_filter: bool
    num_logprobs: int  # top logprobs to return (max over rows); -1: no row wants logprobs
    # Bad words of several tokens (`step_inputs.bad_word_arrays`), None when no row has one:
    bad_rows: torch.Tensor | None = None  # [words] int64: the sampling row of each
    bad_last: torch.Tensor | None = None  # [words] int64: the token banned after the others
    bad_prefix: torch.Tensor | None = None  # [words, H] int64: the others, right-aligned, ANY_TOKEN-padded


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None = None  # [rows] logprob of the sampled token (raw model distribution)
    ranks: torch.Tensor | None = None  # [rows] 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None  # [rows, k]
    top_logprobs: torch.Tensor | None = None  # [rows, k]


class Sampler:
    def __init__(self, kernels_for=None):
        """kernels_for: logits -> the fused kernels module to run on them, or None for the torch ops
        (`layers.fused_kernels_for`; the runner passes it, the sampler imports no kernels itself)."""
        self.kernels_for = kernels_for

    def __call__(self, logits: torch.Tensor, t: SamplingTensors, num_generated: torch.Tensor,
                 output_counts: torch.Tensor | None, allowed: torch.Tensor | None = None,
                 recent: torch.Tensor | None = None) -> SampleOutput:
        # logits: [rows, vocab] in the model's dtype or float32; num_generated: [rows] output tokens so far;
        # allowed: [rows, vocab] bool from guided decoding (None: unconstrained);
        # recent: [rows, H] the latest outputs, with bad words of several tokens (`ban_bad_words`)
        if self.kernels_for is not None and self._plain_greedy(t, allowed):
            fused = self.kernels_for(logits)
            if fused is not None:
                # one kernel over the logits as the model wrote them: no float32 copy, ban and argmax fused
                return SampleOutput(tokens=fused.greedy_sample(logits, t.stop_ids, t.min_tokens, num_generated))
        raw = logits.float()
        logits = self.processed_logits(raw, t, num_generated, output_counts, allowed, recent)
        if t.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, t, num_generated)
        out = SampleOutput(tokens=tokens)
        if t.num_logprobs >= 0:
            self._logprobs(raw, out, t.num_logprobs)
        return out

    @classmethod
    def processed_logits(cls, logits: torch.Tensor, t: SamplingTensors, num_generated: torch.Tensor,
                         output_counts: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                         recent: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits with every per-row change applied (grammar, bias, bad words, min_tokens' ban,
        penalties): greedy takes their argmax, sampling their softmax at the row's temperature."""
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if t.logit_bias is not None:
            logits = logits + t.logit_bias
        if t.bad_last is not None:
            logits = ban_bad_words(logits, t, recent)
        if t.stop_ids.shape[1]:
            # min_tokens: a stop token may not be sampled before the row has min_tokens outputs
            ban = (num_generated < t.min_tokens).unsqueeze(1) & (t.stop_ids >= 0)
            penalty = torch.zeros(ban.shape, dtype=logits.dtype, device=logits.device).masked_fill(ban, float("-inf"))
            logits = logits.scatter_add(1, t.stop_ids.clamp(min=0), penalty)
        if t.presence is not None:
            logits = cls._apply_penalties(logits, t, output_counts)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The distribution a sampling row draws from: softmax of the processed logits at its temperature,
        then min-p, top-k and top-p (unnormalized after the filters; greedy rows at temperature 1)."""
        temperature = torch.where(t.temperature <= 0, torch.ones_like(t.temperature), t.temperature)
        probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
        return _filter(probs, t) if t.any_filter else probs

    @staticmethod
    def _plain_greedy(t: SamplingTensors, allowed: torch.Tensor | None) -> bool:
        """Greedy rows whose only logit change is min_tokens' stop-token ban, and no logprobs."""
        return (t.all_greedy and allowed is None and t.logit_bias is None and t.bad_last is None
                and t.presence is None and t.num_logprobs < 0)

    @staticmethod
    def _apply_penalties(logits, t: SamplingTensors, counts: torch.Tensor) -> torch.Tensor:
        seen = (counts > 0) | t.prompt_mask
        rep = t.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - t.frequency.unsqueeze(1) * counts - t.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)

    @classmethod
    def _sample(cls, logits, t: SamplingTensors, num_generated) -> torch.Tensor:
        greedy = t.temperature <= 0
        probs = cls.probs(logits, t)
        noise = exponential_noise(t.seeds, num_generated, probs.shape[1])
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _logprobs(raw: torch.Tensor, out: SampleOutput, k: int) -> None:
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        chosen = logprobs.gather(1, out.tokens.unsqueeze(1))
        out.logprobs = chosen.squeeze(1)
        out.ranks = (logprobs > chosen).sum(dim=-1) + 1
        if k > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(k, dim=-1)


def ban_bad_words(logits: torch.Tensor, t: SamplingTensors, recent: torch.Tensor) -> torch.Tensor:
    """vLLM's bad words of several tokens: a word's last token goes to -inf in a row whose latest outputs
    are the word's other tokens. On the device: `recent` advances with every sampled token, so a word
    whose tokens straddle steps or windows is caught at every N alike."""
    seen = recent.index_select(0, t.bad_rows)  # [words, H]
    match = ((seen == t.bad_prefix) | (t.bad_prefix == ANY_TOKEN)).all(dim=1)
    penalty = torch.zeros(match.shape, dtype=logits.dtype, device=logits.device).masked_fill(match, float("-inf"))
    # Two words of a row may ban the same token: accumulate (-inf + -inf stays -inf), never overwrite.
    return logits.index_put((t.bad_rows, t.bad_last), penalty, accumulate=True)


def _filter(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """min-p, then top-k and top-p in sorted order; the most likely token always survives."""
    probs = probs.masked_fill(probs < t.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    keep = ranks < t.top_k.unsqueeze(1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < t.top_p.unsqueeze(1) * sorted_probs.sum(dim=-1, keepdim=True)
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
