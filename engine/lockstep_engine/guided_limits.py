"""Bounds on user-supplied JSON schemas and grammars, checked before llguidance (native code) sees them.

llguidance builds a grammar by recursion over its rules, about 2.7 KB of stack a level: a chain of
rules deep enough overflows the stack of the thread that compiles it and the whole process dies with
SIGSEGV. Measured with llguidance 1.9: on an 8 MiB stack a chain of 2500 `$ref`s (`$defs` d0 -> d1
-> ... -> d2500) or of 3000 Lark rules crashed, 2000 did not; on 2 MiB, 800 Lark rules crashed.
So a schema may go at most `MAX_SCHEMA_DEPTH` levels deep, `$ref` hops counted (a chain of refs is a
chain of rules), with at most `MAX_SCHEMA_DEFINITIONS` definitions, and a grammar may define at most
`MAX_GRAMMAR_RULES` rules and terminals (no chain of rules is longer than their number): about 1.4 MB
of stack at most. Every walk here is iterative: no input can reach Python's recursion limit either.

A cycle of `$ref`s alone (`a` -> `b` -> `a`, or `{"$ref": "#"}`) defines nothing: it matches no JSON
value, and llguidance reports it only as `NoExtensionBias` once a matcher computes its first mask; it
is refused here by name.
"""

from __future__ import annotations

import re
from typing import Any

MAX_SCHEMA_NESTING = 128  # levels of JSON objects and arrays in a schema document (llguidance's parser stops there)
MAX_SCHEMA_DEPTH = 128  # subschemas nested in one another, each `$ref` followed counted as a level
MAX_SCHEMA_DEFINITIONS = 1000  # entries of `$defs` and `definitions`, all of them together
MAX_GRAMMAR_RULES = 500  # rule and terminal definitions in a Lark grammar (a GBNF one once converted)

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
# A Lark definition starts a line: `name:`, `?name:`, `!name:`, `NAME.2:` (GBNF's `name ::=` is converted first).
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)


def nesting_problem(value: Any, limit: int = MAX_SCHEMA_NESTING) -> str | None:
    """What is wrong when `value` nests objects and arrays more than `limit` deep, else None."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return f"the schema nests objects and arrays more than {limit} levels deep; at most {limit} are allowed"
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


def schema_problem(schema: dict) -> str | None:
    """What makes `schema` unfit to compile (too deep through its `$ref`s, too many definitions, a cycle
    of `$ref`s alone), else None. Call `nesting_problem` first: this walk takes the nesting as bounded."""
    nodes, definitions = _subschemas(schema)
    if definitions > MAX_SCHEMA_DEFINITIONS:
        return f"{definitions} definitions in $defs/definitions; at most {MAX_SCHEMA_DEFINITIONS} are allowed"
    cycle = _ref_cycle(schema, nodes)
    if cycle is not None:
        shown = cycle if len(cycle) <= 6 else [*cycle[:3], f"... ({len(cycle) - 1} $refs in all)", *cycle[-2:]]
        return (f"$ref cycle {' -> '.join(shown)}: a schema that only refers to itself matches no JSON value "
                f"(give it a type or properties)")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return (f"subschemas and the $refs between them go {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are "
                f"allowed (each $ref followed counts as a level)")
    return None


def grammar_problem(lark: str) -> str | None:
    """What is wrong when a Lark grammar defines too many rules, else None."""
    count = sum(1 for _ in _LARK_DEFINITION.finditer(lark))
    if count > MAX_GRAMMAR_RULES:
        return (f"{count} rule and terminal definitions; at most {MAX_GRAMMAR_RULES} are allowed (llguidance "
                f"compiles a chain of rules by recursion, a stack frame per rule)")
    return None


# ---- the schema walk -----------------------------------------------------------------------------
def _children(node: dict) -> list:
    found = []
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            found.extend(child for child in node[key].values() if isinstance(child, dict))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            found.extend(child for child in node[key] if isinstance(child, dict))
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), dict):
            found.append(node[key])
    return found


def _subschemas(schema: dict) -> tuple[list[dict], int]:
    """Every subschema (the root first) and the number of definitions among them."""
    nodes, stack, definitions = [], [schema], 0
    while stack:
        node = stack.pop()
        nodes.append(node)
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                definitions += len(node[key])
        stack.extend(_children(node))
    return nodes, definitions


def _resolve(root: dict, ref: Any) -> dict | None:
    """The subschema a local `$ref` (`#`, `#/$defs/a`, any JSON pointer into the document) names, else None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _ref_cycle(root: dict, nodes: list[dict]) -> list[str] | None:
    """The refs of a cycle made of `$ref`s alone, else None: each node has one `$ref` at most, so each
    node starts one chain; a chain ends at a node without one, or at a node already known to end."""
    ends: set[int] = set()
    for start in nodes:
        chain, seen, node = [], {}, start
        while isinstance(node, dict) and "$ref" in node and id(node) not in ends:
            if id(node) in seen:
                return chain[seen[id(node)]:] + [chain[seen[id(node)]]]
            seen[id(node)] = len(chain)
            chain.append(str(node["$ref"]))
            node = _resolve(root, node["$ref"])
        ends.update(seen)
    return None


def _depth(root: dict) -> int:
    """The most subschemas on one path from the root, a `$ref` leading to its target; a path that
    comes back to a subschema it is in stops there (recursion in a schema is allowed). Depth-first,
    each subschema's depth computed once, with a stack of its own."""
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[dict, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        edges = _children(node)
        target = _resolve(root, node.get("$ref"))
        if target is not None:
            edges.append(target)
        if children_done:
            on_path.discard(key)
            depths[key] = 1 + max((depths.get(id(edge), 0) for edge in edges), default=0)
            continue
        if key in depths or key in on_path:
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((edge, False) for edge in edges if id(edge) not in depths and id(edge) not in on_path)
    return depths[id(root)]
