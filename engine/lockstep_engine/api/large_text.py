"""Tokenizing very large texts in a process of its own, so they cannot stall the API server's event loop.

A Hugging Face fast tokenizer releases the GIL while it encodes, but turning its millions of ids into
Python ints (and transformers' copies of them) holds it: for a 10 MB prompt that was 0.6-0.9 s in
which `/health` and every stream waited. Texts of `LARGE_TEXT_CHARS` or more therefore go to one
worker process holding the same tokenizer (its `tokenizer.json`, rebuilt with `tokenizers`), which
sends back the ids as packed int32 bytes; the server reads their count without making an int per id,
and converts them only when the prompt fits the context (at most `max_model_len` ids). The worker
(lockstep_common/worker_process.py) dies with the API process, however that one ends.
"""

from __future__ import annotations

from array import array

from lockstep_common.worker_process import WorkerProcess
from lockstep_engine.api.errors import bad_request
from lockstep_engine.sampling_params import SamplingParamsError
from lockstep_engine.validation import validate_prompt

LARGE_TEXT_CHARS = 1 << 20  # about 250k tokens of English: above any prompt that is quick to tokenize
ENCODE_TIMEOUT_S = 300.0  # a 10 MB text took up to 39 s on a loaded two-core machine

_worker_tokenizer = None


def _load(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(argument: tuple[str, bool]) -> bytes:
    text, add_special_tokens = argument
    return array("i", _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids).tobytes()


class LargeTextEncoder:
    """One lazily started worker process; `encode` blocks its (non-loop) calling thread, not the GIL."""

    def __init__(self, tokenizer):
        self._worker = WorkerProcess("large-text tokenizer worker", _encode, initializer=_load,
                                     initargs=(tokenizer.backend_tokenizer.to_str(),))

    @staticmethod
    def supports(tokenizer) -> bool:
        return getattr(tokenizer, "backend_tokenizer", None) is not None  # a fast (Rust) tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> array:
        ids = array("i")
        ids.frombytes(self._worker.call((text, add_special_tokens), ENCODE_TIMEOUT_S))
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
        self._worker.close()
