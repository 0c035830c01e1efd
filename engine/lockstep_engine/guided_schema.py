"""Grammar compilation for guided decoding, with no torch: the API server checks constraints with it.

A constraint travels as a guided spec, a dict with exactly one of the keys in `GUIDED_KINDS`
(`SamplingParams.guided`, or `{"json": schema}` for `SamplingParams.json_schema`). The API server
compiles every spec once to refuse a bad one with a 400 before the request reaches the core; the
core's `guided.GuidedDecoding` compiles it again for its matchers.
"""

from __future__ import annotations

import json
from typing import Any

# Compact JSON: flexible whitespace lets a small model wander into endless blanks.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GuidedDecodingError(ValueError):
    """A schema that cannot be compiled; the message says why."""


def llguidance_module():
    """The llguidance package, or None when it is not installed."""
    try:
        import llguidance
    except ImportError:  # the engine extra installs it; a bare torch install may not have it
        return None
    return llguidance


def is_available() -> bool:
    return llguidance_module() is not None


def compile_json_schema(schema: dict[str, Any]) -> str:
    """Returns the llguidance grammar for a JSON schema; raises GuidedDecodingError when it is invalid."""
    llguidance = llguidance_module()
    if llguidance is None:
        raise GuidedDecodingError("guided decoding needs the 'llguidance' package (pip install llguidance)")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as error:
        raise GuidedDecodingError(f"not a valid JSON schema: {error}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GuidedDecodingError(f"unsupported JSON schema: {problem}")
    return grammar


# What each kind holds: json a JSON schema (dict), regex a regular expression (Rust regex syntax),
# choice a list of strings, grammar a Lark grammar or a GBNF one (llguidance converts GBNF to Lark).
GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def compile_guided(spec: dict[str, Any]) -> str:
    """Returns the llguidance grammar for a guided spec; raises GuidedDecodingError naming what is wrong."""
    llguidance = llguidance_module()
    if llguidance is None:
        raise GuidedDecodingError("guided decoding needs the 'llguidance' package (pip install llguidance)")
    if len(spec) != 1 or next(iter(spec)) not in GUIDED_KINDS:
        raise GuidedDecodingError(f"expected exactly one of {', '.join(GUIDED_KINDS)}, got {sorted(spec)}")
    kind, value = next(iter(spec.items()))
    if kind == "json":
        if not isinstance(value, dict):
            raise GuidedDecodingError(f"json: expected a JSON schema object, got {type(value).__name__}")
        return compile_json_schema(value)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise GuidedDecodingError("regex: expected a non-empty regular expression string")
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GuidedDecodingError("choice: expected a non-empty list of non-empty strings")
        # JSON string literals are Lark string literals, so any choice text is quoted exactly.
        lark = "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        if not isinstance(value, str) or not value.strip():
            raise GuidedDecodingError("grammar: expected a non-empty Lark or GBNF grammar string")
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        try:
            lark = any_to_lark(value)
        except GbnfToLarkError as error:
            raise GuidedDecodingError(f"grammar: not a valid GBNF grammar: {error}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GuidedDecodingError(f"{kind}: {problem.strip()}")
    return grammar
