"""Tokenizing very large texts in a process of its own, so they cannot stall the API server's event loop.

A Hugging Face fast tokenizer releases the GIL while it encodes, but turning its millions of ids into
Python ints (and transformers' copies of them) holds it: for a 10 MB prompt that was 0.6-0.9 s in
which `/health` and every stream waited. Texts of `LARGE_TEXT_CHARS` or more therefore go to one
worker process holding the same tokenizer (its `tokenizer.json`, rebuilt with `tokenizers`), which
sends back the ids as packed int32 bytes; the server reads their count without making an int per id,
and converts them only when the prompt fits the context (at most `max_model_len` ids). The worker
(lockstep_common/worker_process.py) dies with the API process, however that one ends.

A text far longer than the context is judged on a prefix first: the worker encodes the text up to a
space near `PREFIX_CHARS_PER_TOKEN` characters per token of the context (a byte-level BPE attaches a
space to the word after it, so the prefix's ids are the text's first ids), and when those already
overflow the context by `PREFIX_MARGIN` the prompt is refused without encoding the rest: a 15 MB text
was refused after 18-21 s of tokenizing (5,555,552 ids), now after the prefix.
"""

from __future__ import annotations

from array import array

from lockstep_common.worker_process import WorkerProcess
from lockstep_engine.api.errors import bad_request
from lockstep_engine.sampling_params import SamplingParamsError
from lockstep_engine.validation import validate_prompt

LARGE_TEXT_CHARS = 1 << 20  # about 250k tokens of English: above any prompt that is quick to tokenize
ENCODE_TIMEOUT_S = 300.0  # a 10 MB text took up to 39 s on a loaded two-core machine
PREFIX_CHARS_PER_TOKEN = 64  # English runs at about 4 characters a token; only runs of one character go past 64
PREFIX_MARGIN = 64  # ids the prefix's cut word may add over the text's own first ids, and then some

_worker_tokenizer = None


def _load(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(argument: tuple[str, bool, int | None]) -> tuple[bool, bytes]:
    """(whole, ids): `whole` is False when the ids are a prefix's, already `limit` + PREFIX_MARGIN or more."""
    text, add_special_tokens, limit = argument
    if limit is not None and len(text) > limit * PREFIX_CHARS_PER_TOKEN:
        cut = text.rfind(" ", 0, limit * PREFIX_CHARS_PER_TOKEN)
        if cut > 0:
            ids = _worker_tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens).ids
            if len(ids) >= limit + PREFIX_MARGIN:
                return False, array("i", ids).tobytes()
    return True, array("i", _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids).tobytes()


class LargeTextEncoder:
    """One lazily started worker process; `encode` blocks its (non-loop) calling thread, not the GIL."""

    def __init__(self, tokenizer):
        self._worker = WorkerProcess("large-text tokenizer worker", _encode, initializer=_load,
                                     initargs=(tokenizer.backend_tokenizer.to_str(),))

    @staticmethod
    def supports(tokenizer) -> bool:
        return getattr(tokenizer, "backend_tokenizer", None) is not None  # a fast (Rust) tokenizer

    def encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> tuple[bool, array]:
        """(whole, ids); with a `limit`, ids may be a prefix's that already holds `limit` ids or more."""
        whole, packed = self._worker.call((text, add_special_tokens, limit), ENCODE_TIMEOUT_S)
        ids = array("i")
        ids.frombytes(packed)
        return whole, ids

    def encode_prompt(self, text: str, add_special_tokens: bool, config, model_config, param: str) -> list[int]:
        """The ids of a prompt, or the 400 for one too long for the context, judged on the count alone."""
        whole, ids = self.encode(text, add_special_tokens, config.max_model_len)
        if not whole:
            raise bad_request(f"{param}: a text of {len(text)} characters whose first {len(ids)} tokens already "
                              f"exceed max_model_len={config.max_model_len} (a prompt must leave room for one "
                              f"output token)", param)
        if len(ids) >= config.max_model_len:
            try:
                validate_prompt(config, model_config, ids)
            except SamplingParamsError as error:
                raise bad_request(str(error), param) from None
        return ids.tolist()

    def shutdown(self) -> None:
        self._worker.close()
