"""The error every spec check raises (spec, sources, lora): a field and what is wrong with it."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec a user wrote cannot be served; the message names the field and the allowed values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
