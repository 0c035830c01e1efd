"""Structured outputs as vLLM takes them: `guided_*` fields, `structured_outputs`, `response_format`.

Every spelling becomes one guided spec (`guided_schema.GUIDED_KINDS`) in `SamplingParams.guided`,
compiled once off the event loop (grammar_check.py) so a bad constraint is a 400 naming its field
before the request reaches the core. More than one constraint on a request is a 400, as in vLLM; so is an option that would
change the grammar in a way llguidance is not asked to (a whitespace pattern, structural tags).
"""

from __future__ import annotations

import json
from typing import Any

from lockstep_engine.api import tools
from lockstep_engine.api.errors import bad_request

# `guided_decoding_backend` / `structured_outputs.backend` values that mean "whatever the server uses".
_BACKENDS = ("auto", "guidance", "llguidance")
# structured_outputs keys that carry a constraint, and the guided kind each becomes.
_OUTPUT_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# structured_outputs options this server honours as vLLM defines them: JSON is compact already and
# there is no fallback backend, so both flags hold whatever their value.
_HONOURED_OPTIONS = ("disable_any_whitespace", "disable_fallback", "backend")


def _json_schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param}: not valid JSON: {error}", param) from None
        except RecursionError:
            raise bad_request(f"{param}: the schema nests objects and arrays too deeply to parse", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: expected a JSON schema object, got {type(value).__name__}", param)
    return value


def _check_backend(value: Any, param: str) -> None:
    if value is not None and value not in _BACKENDS:
        raise bad_request(f"{param}={value!r} is not available: this server's structured outputs use llguidance "
                          f"(allowed: {', '.join(_BACKENDS)})", param)


def _from_structured_outputs(outputs: dict) -> list[tuple[str, dict]]:
    specs = []
    for key, value in outputs.items():
        param = f"structured_outputs.{key}"
        if key in _OUTPUT_KINDS:
            if value is None:
                continue
            kind = _OUTPUT_KINDS[key]
            specs.append((param, {kind: _json_schema(value, param) if kind == "json" else value}))
        elif key == "json_object":
            if value:
                specs.append((param, {"json": {"type": "object"}}))
        elif key == "backend":
            _check_backend(value, param)
        elif key in _HONOURED_OPTIONS:
            continue
        elif key == "disable_additional_properties":
            if value:
                raise bad_request(f"{param}=true is not supported: schemas are enforced as written; set "
                                  f"additionalProperties: false in the schema instead", param)
        elif value is not None:
            raise bad_request(f"{param} is not supported by this server (supported: json, regex, choice, grammar, "
                              f"json_object, {', '.join(_HONOURED_OPTIONS)})", param)
    return specs


def guided_constraint(body, response_format_schema: dict | None, ready) -> tuple[str, dict] | None:
    """The request's one constraint as (its field, its guided spec), or None; 400 on a second one.

    The spec is not compiled here: `grammar_check.GrammarChecker` does that off the event loop.
    `response_format_schema` is what `response_format` asked for (already checked by the caller);
    `ready` the core's ready message (None before it came), which says whether it can guide at all.
    """
    specs: list[tuple[str, dict]] = list(tools.forced_specs(body))
    if response_format_schema is not None:
        specs.append(("response_format", {"json": response_format_schema}))
    if body.guided_json is not None:
        specs.append(("guided_json", {"json": _json_schema(body.guided_json, "guided_json")}))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            specs.append((name, {kind: value}))
    if body.structured_outputs is not None:
        specs.extend(_from_structured_outputs(body.structured_outputs))
    _check_backend(body.guided_decoding_backend, "guided_decoding_backend")
    if body.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported: JSON is generated without optional "
                          "whitespace", "guided_whitespace_pattern")
    if not specs:
        return None
    if len(specs) > 1:
        names = ", ".join(param for param, _ in specs)
        raise bad_request(f"only one structured-output constraint per request is allowed, got {names}", specs[1][0])
    param, spec = specs[0]
    if ready is not None and not ready.guided_decoding:
        raise bad_request(f"{param}: this model has no tokenizer for structured outputs (or llguidance is not "
                          f"installed)", param)
    return param, spec
