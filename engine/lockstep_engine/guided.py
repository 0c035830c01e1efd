"""Guided decoding (`response_format`, `guided_*`, `structured_outputs`, tool calls) with llguidance.

llguidance compiles a JSON schema into a grammar and computes the allowed-token bitmask of a
sequence in tens of microseconds from its own tokenizer trie; it is what vLLM, SGLang and
llama.cpp use for the same job. Here each guided sequence carries its own `LLMatcher` (attribute
`guided_matcher`), so its grammar state survives across windows and preemption; a window's `Guide`
turns the matchers' bitmasks into one `[rows, vocab]` bool mask on the device per step and feeds
every sampled token back.

A grammar compiles off the core's loop: `prepare` builds a sequence's first matcher in a worker
thread (llguidance drops the GIL while it builds the lexer, and the first mask, which builds most of
it, is computed there too); the core process holds the request back until it is ready
(core_process.py), and every sequence of that grammar then starts from a copy of it. A 100,000-choice
list takes about a second there; the other streams go on meanwhile.

A grammar that reaches the core through the API server was compiled first, by the same llguidance,
in the API's grammar worker process (api/grammar_worker.py) on a smaller stack than this thread's,
within the bounds of guided_limits.py: a grammar that would crash llguidance crashes that worker
(the request gets a 400) and never gets here. Only a choice list is not compiled there; its grammar
is one terminal of quoted literals, written by `grammar_for`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from lockstep_engine.guided_schema import (
    GuidedDecodingError,
    compile_guided,
    grammar_for,
    is_available,
    llguidance_module,
    matcher_error,
)

MATCHER_ATTR = "guided_matcher"
TEMPLATE_ATTR = "guided_template"  # on a Request: the warmed matcher its sequences copy (`prepare`)
MAX_TEMPLATES = 64  # warmed matchers kept for requests with the same grammar


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
        self._templates: OrderedDict[str, object] = OrderedDict()  # guided spec JSON -> warmed matcher
        self._templates_lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="lockstep-grammar")
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def prepare(self, spec: dict) -> Future:
        """A future of the warmed matcher for `spec` (GuidedDecodingError when it cannot compile), built
        in the worker thread unless one for the same grammar is kept already."""
        return self._compiler.submit(self._template, spec)

    def _template(self, spec: dict):
        key = json.dumps(spec, sort_keys=True)
        with self._templates_lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        template = self._llguidance.LLMatcher(self.tokenizer, grammar_for(spec), log_level=0)
        words = (self.vocab_size + 31) // 32
        first = np.zeros(words, dtype=np.int32)
        if not template.is_error():
            template.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if template.is_error():
            raise GuidedDecodingError(f"{next(iter(spec))}: {matcher_error(template.get_error())}")
        with self._templates_lock:
            self._templates[key] = template
            while len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        return template

    def matcher_for(self, seq):
        """The sequence's matcher, created on first use and caught up with tokens it already has."""
        matcher = getattr(seq, MATCHER_ATTR, None)
        if matcher is None:
            template = getattr(seq.request, TEMPLATE_ATTR, None)
            if template is not None:
                matcher = template.deep_copy()
            else:  # a rank that was not asked to `prepare` (a worker of a group): compiled here, in the window
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
