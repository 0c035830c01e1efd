"""Grammar compilation for guided decoding, with no torch: the API server checks constraints with it.

A constraint travels as a guided spec, a dict with exactly one of the keys in `GUIDED_KINDS`
(`SamplingParams.guided`, or `{"json": schema}` for `SamplingParams.json_schema`). The API server
compiles every spec once, off its event loop (api/grammar_check.py), to refuse a bad one with a 400
before the request reaches the core; the core's `guided.GuidedDecoding` compiles it again for its
matchers, off its loop too.

Limits (`check_limits`) keep one request from buying unbounded compile time: the number of choices,
the size of a spec, and how deeply counted repetitions (`{n}`, `{n,m}`) nest in a regex or grammar,
because each nesting level multiplies the states llguidance's lexer builds: `(a{1000}){1000}` took
3.6 s for its first mask on the CPU, `(a{100}){100}` 30 ms. The bounds that keep llguidance's stack
from overflowing (the depth of a schema through its `$ref`s, its definitions, a grammar's rules) are
in guided_limits.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lockstep_engine.guided_limits import grammar_problem, nesting_problem, schema_problem

# Compact JSON: flexible whitespace lets a small model wander into endless blanks.
_JSON_OPTIONS = {"whitespace_flexible": False}


# Choices, spec characters (choice texts, a regex, a grammar, a JSON schema's JSON) and the product of
# nested counted repetitions a request may ask for; past them a spec is refused before it compiles.
MAX_GUIDED_CHOICES = 100_000
MAX_GUIDED_SPEC_CHARS = 4_000_000
MAX_NESTED_REPETITION = 10_000


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


def _llguidance():
    llguidance = llguidance_module()
    if llguidance is None:
        raise GuidedDecodingError("guided decoding needs the 'llguidance' package (pip install llguidance)")
    return llguidance


def _json_grammar(schema: dict[str, Any]) -> str:
    try:
        text = json.dumps(schema)
    except (ValueError, TypeError, RecursionError) as error:
        raise GuidedDecodingError(f"not a valid JSON schema: {error}") from None
    if len(text) > MAX_GUIDED_SPEC_CHARS:
        raise GuidedDecodingError(f"the schema is {len(text)} characters of JSON; at most {MAX_GUIDED_SPEC_CHARS} "
                                  f"are allowed")
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as error:
        raise GuidedDecodingError(f"not a valid JSON schema: {shortened(str(error))}") from None


def compile_json_schema(schema: dict[str, Any]) -> str:
    """Returns the llguidance grammar for a JSON schema; raises GuidedDecodingError when it is invalid."""
    grammar = _json_grammar(schema)
    problem = _llguidance().LLMatcher.validate_grammar(grammar)
    if problem:
        raise GuidedDecodingError(f"unsupported JSON schema: {shortened(problem)}")
    return grammar


_COUNT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def nested_repetition(text: str) -> int:
    """The largest product of counted repetitions nested in one another (`(a{10}){20}`: 200) in a regex
    or a grammar's text; 1 when no counted repetition sits inside another. A scan, not a parser: escapes
    and character classes are skipped, string literals of a grammar are read as pattern text."""
    stack = [1]  # per open group: the largest product inside it so far
    last = 1  # the product of the atom just read (a group's inner product after its ')')
    worst = 1
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 1
            continue
        if ch == "[":
            j = i + 2 if text[i + 1:i + 2] == "]" else i + 1
            while j < len(text) and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if ch == "{":
            count = _COUNT.match(text, i)
            if count is not None:
                bound = int(count[3]) if count[3] else int(count[1])
                if last > 1:
                    worst = max(worst, last * bound)
                last = last * bound
                stack[-1] = max(stack[-1], last)
                i = count.end()
                continue
        if ch == "(":
            stack.append(1)
            last = 1
        elif ch == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
        else:
            last = 1
        i += 1
    return worst


def _check_text(kind: str, text: str) -> None:
    if len(text) > MAX_GUIDED_SPEC_CHARS:
        raise GuidedDecodingError(f"{kind}: {len(text)} characters; at most {MAX_GUIDED_SPEC_CHARS} are allowed")
    product = nested_repetition(text)
    if product > MAX_NESTED_REPETITION:
        raise GuidedDecodingError(f"{kind}: nested counted repetitions multiply to {product}; at most "
                                  f"{MAX_NESTED_REPETITION} are allowed (each nesting level multiplies the work)")


def check_limits(spec: dict[str, Any]) -> None:
    """The cheap checks, fit for an event loop: the shape of the spec and the number of choices."""
    if len(spec) != 1 or next(iter(spec)) not in GUIDED_KINDS:
        raise GuidedDecodingError(f"expected exactly one of {', '.join(GUIDED_KINDS)}, got {sorted(spec)}")
    kind, value = next(iter(spec.items()))
    if kind == "choice" and isinstance(value, list) and len(value) > MAX_GUIDED_CHOICES:
        raise GuidedDecodingError(f"choice: {len(value)} choices; at most {MAX_GUIDED_CHOICES} are allowed")


# What each kind holds: json a JSON schema (dict), regex a regular expression (Rust regex syntax),
# choice a list of strings, grammar a Lark grammar or a GBNF one (llguidance converts GBNF to Lark).
GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def grammar_for(spec: dict[str, Any]) -> str:
    """The llguidance grammar for a guided spec, not validated yet (`compile_guided`, or an `LLMatcher`,
    which reports what is wrong); raises GuidedDecodingError for a spec that breaks a limit or its shape."""
    llguidance = _llguidance()
    check_limits(spec)
    kind, value = next(iter(spec.items()))
    if kind == "json":
        if not isinstance(value, dict):
            raise GuidedDecodingError(f"json: expected a JSON schema object, got {type(value).__name__}")
        return _json_grammar(value)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise GuidedDecodingError("regex: expected a non-empty regular expression string")
        _check_text(kind, value)
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        check_choices(value)
        # One terminal, not one rule with an alternative per choice: llguidance's parser allows 2000 items
        # in a grammar row (a longer list left the matcher in an error state, and the output was none of
        # the choices); its lexer takes any number of alternatives. JSON string literals are Lark string
        # literals, so any choice text is quoted exactly; the list is encoded in one call, " | " between
        # its items (a quote never stands unescaped inside a JSON string, so the separator is exact).
        # JSON leaves DEL (U+007F) raw, which the Lark lexer refuses: it gets the escape JSON would allow.
        alternatives = json.dumps(value, ensure_ascii=False, separators=(" | ", ":"))[1:-1].replace("\x7f", "\\u007f")
        lark = "start: CHOICE\nCHOICE: " + alternatives
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if not isinstance(value, str) or not value.strip():
        raise GuidedDecodingError("grammar: expected a non-empty Lark or GBNF grammar string")
    _check_text(kind, value)
    problem = grammar_problem(value)  # before the GBNF conversion, which took 23 s for 10,000 rules
    if problem is not None:
        raise GuidedDecodingError(f"grammar: {problem}")
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        lark = any_to_lark(value)
    except GbnfToLarkError as error:
        raise GuidedDecodingError(f"grammar: not a valid GBNF grammar: {error}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_choices(value: Any) -> None:
    """A choice list's shape and size (GuidedDecodingError naming what is wrong)."""
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise GuidedDecodingError("choice: expected a non-empty list of non-empty strings")
    size = sum(map(len, value))
    if size > MAX_GUIDED_SPEC_CHARS:
        raise GuidedDecodingError(f"choice: {size} characters in all; at most {MAX_GUIDED_SPEC_CHARS} are allowed")


def check_guided(spec: dict[str, Any]) -> None:
    """What the API server checks before a request reaches the core (in a worker process of its own,
    api/grammar_worker.py): a choice list's shape and size only, since its grammar (quoted literals,
    written by `grammar_for`) llguidance always accepts (validating 100,000 choices took a CPU core for
    0.9 s, beside the core's own compile of the same list on a two-core machine). Any other spec: a
    schema's bounds (guided_limits.py), `compile_guided`, then the first mask of a matcher over a
    tokenizer of single bytes, which shows a grammar that allows no output at all (no tokenizer of the
    model is needed for that, and none is loaded)."""
    check_limits(spec)
    kind, value = next(iter(spec.items()))
    if kind == "choice":
        check_choices(value)
        return
    if kind == "json" and isinstance(value, dict):
        problem = nesting_problem(value) or schema_problem(value)
        if problem is not None:
            raise GuidedDecodingError(problem)
    grammar = compile_guided(spec)
    llguidance = _llguidance()
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise GuidedDecodingError(f"{kind}: {matcher_error(matcher.get_error())}")


def matcher_error(error: str) -> str:
    """An `LLMatcher`'s error in words: its first line, or what `NoExtensionBias` (llguidance's name for
    a grammar under which no token at all may come first) means."""
    if error.startswith("NoExtensionBias"):
        return ("the constraint allows no output at all (a rule or $ref that only refers to itself, or a cycle of "
                "them, never reaches any text)")
    return shortened(error.splitlines()[0] if error.strip() else "the grammar cannot be used")


def shortened(text: str, limit: int = 400) -> str:
    """llguidance's message, cut to `limit` characters: it quotes the offending input, which may be megabytes."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " [...]"


class _ByteTokens:
    """A vocabulary of the 256 bytes and an end of sequence, for llguidance's `TokenizerWrapper`."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([byte]) for byte in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_byte_tokenizer_instance = None


def _byte_tokenizer():
    global _byte_tokenizer_instance
    if _byte_tokenizer_instance is None:
        llguidance = _llguidance()
        _byte_tokenizer_instance = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
    return _byte_tokenizer_instance


def compile_guided(spec: dict[str, Any]) -> str:
    """Returns the llguidance grammar for a guided spec; raises GuidedDecodingError naming what is wrong."""
    grammar = grammar_for(spec)
    problem = _llguidance().LLMatcher.validate_grammar(grammar)
    if problem:
        kind = next(iter(spec))
        raise GuidedDecodingError(f"{kind}: {shortened(problem)}" if kind != "json" else
                                  f"unsupported JSON schema: {shortened(problem)}")
    return grammar
