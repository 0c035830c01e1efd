"""Guided decoding (`response_format`, `guided_*`, `structured_outputs`, tool calls) with llguidance.

llguidance compiles a JSON schema into a grammar and computes the allowed-token bitmask of a
sequence in tens of microseconds from its own tokenizer trie; it is what vLLM, SGLang and
llama.cpp use for the same job. Here each guided sequence carries its own `LLMatcher` (attribute
`guided_matcher`), so its grammar state survives across windows and preemption; a window's `Guide`
turns the matchers' bitmasks into one `[rows, vocab]` bool mask on the device per step and feeds
every sampled token back.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from lockstep_engine.guided_schema import GuidedDecodingError, compile_guided, is_available, llguidance_module

MATCHER_ATTR = "guided_matcher"


class GuidedDecoding:
    """Builds the per-window `Guide` for `ModelRunner.guide_factory` (one per engine, holds the tokenizer)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device):
        llguidance = llguidance_module()
        if llguidance is None:
            raise GuidedDecodingError("guided decoding needs the 'llguidance' package (pip install llguidance)")
        import llguidance.hf

        self._llguidance = llguidance
        eos = list(eos_token_ids) or None
        # Converting the vocabulary into llguidance's trie takes about a second; done once.
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self._grammars: dict[str, str] = {}  # guided spec JSON -> compiled grammar
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def matcher_for(self, seq):
        """The sequence's matcher, created on first use and caught up with tokens it already has."""
        matcher = getattr(seq, MATCHER_ATTR, None)
        if matcher is None:
            spec = seq.request.params.guided_spec
            key = json.dumps(spec, sort_keys=True)
            grammar = self._grammars.get(key)
            if grammar is None:
                grammar = self._grammars[key] = compile_guided(spec)
            matcher = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            for token in seq.output_token_ids:
                matcher.consume_token(token)
            setattr(seq, MATCHER_ATTR, matcher)
        return matcher

    def __call__(self, rows) -> "WindowGuide":
        matchers = [self.matcher_for(row.seq) if row.seq.request.params.guided_spec is not None else None
                    for row in rows]
        return WindowGuide(self, matchers)

    def expand(self, bitmask: np.ndarray) -> torch.Tensor:
        """[rows, ceil(vocab/32)] int32 bitmask on the host -> [rows, vocab] bool on the device."""
        words = torch.from_numpy(bitmask).to(self.device, non_blocking=False)
        bits = (words.unsqueeze(-1) >> self._shifts) & 1  # [rows, words, 32]; bit i of word w = token 32w+i
        return bits.view(bits.shape[0], -1)[:, :self.vocab_size].bool()


class WindowGuide:
    """Masks for the sampling rows of one window; unguided rows are left unconstrained."""

    def __init__(self, decoding: GuidedDecoding, matchers: list):
        self.decoding = decoding
        self.matchers = matchers
        words = (decoding.vocab_size + 31) // 32
        self._bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
        eos_only = np.zeros(words, dtype=np.uint32)
        for token in decoding.eos_token_ids:
            eos_only[token // 32] |= np.uint32(1 << (token % 32))
        self._eos_only = eos_only.view(np.int32)

    def allowed_mask(self) -> torch.Tensor:
        for row, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            if matcher.is_error() or matcher.is_stopped():
                # Finished (or broken) grammar: only end-of-sequence may follow.
                self._bitmask[row] = self._eos_only
                continue
            target = self._bitmask[row]
            matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        return self.decoding.expand(self._bitmask)

    def accept(self, tokens: list[int]) -> None:
        for matcher, token in zip(self.matchers, tokens):
            if matcher is not None and token >= 0 and not matcher.is_stopped():
                matcher.consume_token(token)


def install(runner, hf_tokenizer) -> bool:
    """Sets `runner.guide_factory` when llguidance and a tokenizer are there; returns whether it did."""
    if hf_tokenizer is None or not is_available():
        return False
    mc = runner.model_config
    runner.guide_factory = GuidedDecoding(hf_tokenizer, mc.vocab_size, tuple(mc.eos_token_ids), runner.device)
    return True
