"""Which request field caps the output tokens (lockstep_common/max_tokens.py), for JSON bodies and parsed requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lockstep_common.max_tokens import requested_max_tokens


@pytest.mark.parametrize(("body", "expected"), [
    ({"max_completion_tokens": 7, "max_tokens": 3}, 7),  # the newer Chat Completions field wins
    ({"max_completion_tokens": None, "max_tokens": 3}, 3),  # null is unset
    ({"max_tokens": 3, "max_output_tokens": 9}, 3),
    ({"max_output_tokens": 9}, 9),  # /v1/responses
    ({"prompt": "hi"}, None),
    ({"max_tokens": "many"}, "many"),  # as given: validating it is the caller's business
])
def test_the_first_field_set_caps_the_output(body, expected):
    assert requested_max_tokens(body) == expected


def test_a_parsed_request_is_read_by_attribute_and_may_lack_a_field():
    chat = SimpleNamespace(max_tokens=5, max_completion_tokens=None)  # no max_output_tokens attribute at all
    assert requested_max_tokens(chat) == 5
