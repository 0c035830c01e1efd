"""What a request may ask for while the engine speculates. Plain Python, no torch."""

from __future__ import annotations


class SpeculationUnsupported(ValueError):
    """A request asks for what speculative windows do not run; `param` names the field (a 400)."""

    def __init__(self, param: str, what: str):
        self.param = param
        super().__init__(f"{param}: {what} is not supported with speculative decoding (--speculative-config)")


def check_speculative(spec, request) -> None:
    """Refuses, by name, what speculative windows do not run (`request`: a `sequence.Request`, `spec` the
    engine's `SpeculativeConfig` or None): a grammar, penalties, bad words of several tokens. Each needs
    the row's tokens of every drafted position before its logits, which the verify forward computes all
    at once."""
    if spec is None:
        return
    params = request.params
    if params.guided_spec is not None:
        raise SpeculationUnsupported("response_format", "guided decoding (structured outputs)")
    if params.has_penalties:
        raise SpeculationUnsupported("presence_penalty/frequency_penalty/repetition_penalty", "a penalty")
    if params.multi_token_bad_words:
        raise SpeculationUnsupported("bad_words", "a bad word of several tokens")
