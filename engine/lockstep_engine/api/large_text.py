"""Tokenizing very large texts in a process of its own, so they cannot stall the API server's event loop.

A Hugging Face fast tokenizer releases the GIL while it encodes, but turning its millions of ids into
Python ints (and transformers' copies of them) holds it: for a 10 MB prompt that was 0.6-0.9 s in
which `/health` and every stream waited. Texts of `LARGE_TEXT_CHARS` or more therefore go to one
worker process holding the same tokenizer (its `tokenizer.json`, rebuilt with `tokenizers`), which
sends back the ids as packed int32 bytes; the server reads their count without making an int per id,
and converts them only when the prompt fits the context (at most `max_model_len` ids).
"""

from __future__ import annotations

import multiprocessing
import threading
from array import array
from concurrent.futures import ProcessPoolExecutor

from lockstep_engine.api.errors import bad_request
from lockstep_engine.sampling_params import SamplingParamsError
from lockstep_engine.validation import validate_prompt

LARGE_TEXT_CHARS = 1 << 20  # about 250k tokens of English: above any prompt that is quick to tokenize

_worker_tokenizer = None


def _load(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(text: str, add_special_tokens: bool) -> bytes:
    return array("i", _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids).tobytes()


class LargeTextEncoder:
    """One lazily started worker process; `encode` blocks its (non-loop) calling thread, not the GIL."""

    def __init__(self, tokenizer):
        self._tokenizer_json = tokenizer.backend_tokenizer.to_str()
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def supports(tokenizer) -> bool:
        return getattr(tokenizer, "backend_tokenizer", None) is not None  # a fast (Rust) tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> array:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_load, initargs=(self._tokenizer_json,))
            pool = self._pool
        ids = array("i")
        ids.frombytes(pool.submit(_encode, text, add_special_tokens).result())
        return ids

    def encode_prompt(self, text: str, add_special_tokens: bool, config, model_config, param: str) -> list[int]:
        """The ids of a prompt, or the 400 for one too long for the context, judged on the count alone."""
        ids = self.encode(text, add_special_tokens)
        if len(ids) >= config.max_model_len:
            try:
                validate_prompt(config, model_config, ids)
            except SamplingParamsError as error:
                raise bad_request(str(error), param) from None
        return ids.tolist()

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
