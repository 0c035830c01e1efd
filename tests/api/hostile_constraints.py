"""Structured-output constraints built to break a grammar compiler, for the engine's and the gateway's fuzz
suites: deep and wide JSON schemas, `$ref` graphs (chains, cycles, diamonds, random graphs from a seed),
deep and long grammars, deep regexes. A chain of 2500 `$ref`s and a grammar of 10,000 chained rules
each killed `lockstep serve` (SIGSEGV in llguidance) before; every case must now be answered 200 or
400, never a 5xx, and the server must live on. `send_all` returns what came back.
"""

from __future__ import annotations

import json
import random

import httpx


def nested_objects(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def ref_chain(length: int) -> dict:
    """`$defs` d0 -> d1 -> ... -> d{length}, the last a string."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_cycle(length: int) -> dict:
    defs = {f"c{i}": {"$ref": f"#/$defs/c{(i + 1) % length}"} for i in range(length)}
    return {"$ref": "#/$defs/c0", "$defs": defs}


def ref_diamonds(levels: int) -> dict:
    """Two definitions a level, each referring to both of the next level: 2**levels paths through them."""
    defs: dict = {}
    for level in range(levels):
        both = [{"$ref": f"#/$defs/l{level + 1}a"}, {"$ref": f"#/$defs/l{level + 1}b"}]
        defs[f"l{level}a"] = {"anyOf": both}
        defs[f"l{level}b"] = {"type": "array", "maxItems": 1, "items": {"anyOf": both}}
    defs[f"l{levels}a"] = {"type": "integer"}
    defs[f"l{levels}b"] = {"type": "boolean"}
    return {"$ref": "#/$defs/l0a", "$defs": defs}


def ref_graph(rng: random.Random, nodes: int) -> dict:
    """Definitions that refer to random others (through objects, arrays, anyOf or bare `$ref`s), some ending
    in a plain type: chains, cycles and diamonds as they fall."""
    defs: dict = {}
    for i in range(nodes):
        target = {"$ref": f"#/$defs/n{rng.randrange(nodes)}"}
        defs[f"n{i}"] = rng.choice([
            {"type": "string"}, target, {"anyOf": [target, {"type": "null"}]},
            {"type": "object", "properties": {"x": target}},
            {"type": "array", "maxItems": 2, "items": target},
        ])
    return {"$ref": f"#/$defs/n{rng.randrange(nodes)}", "$defs": defs}


def lark_chain(length: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(length)) + f'r{length}: "x"\n'


def gbnf_chain(length: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(length)) + f'r{length} ::= "x"\n'


def response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}}


def cases(seed: int = 0) -> list[tuple[str, dict, str]]:
    """(name, the request's constraint fields, the field a 400 names)."""
    rng = random.Random(seed)
    found = [
        ("$ref chain of 2500", response_format(ref_chain(2500)), "response_format"),
        ("$ref chain of 10000", response_format(ref_chain(10_000)), "response_format"),
        ("$ref chain of 300", response_format(ref_chain(300)), "response_format"),
        ("$ref chain of 20", response_format(ref_chain(20)), "response_format"),
        ("$ref cycle of 2", response_format(ref_cycle(2)), "response_format"),
        ("$ref cycle of 500", response_format(ref_cycle(500)), "response_format"),
        ("$ref to the root", response_format({"$ref": "#"}), "response_format"),
        ("$ref diamonds, 40 levels", response_format(ref_diamonds(40)), "response_format"),
        ("$ref to nothing", response_format({"$ref": "#/$defs/missing"}), "response_format"),
        ("objects 60 deep", response_format(nested_objects(60)), "response_format"),
        ("objects 300 deep", response_format(nested_objects(300)), "response_format"),
        ("arrays 200 deep", {"guided_json": nested_arrays(200)}, "guided_json"),
        ("2000 properties", response_format({"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(2000)}}), "response_format"),
        ("1500 definitions", {"guided_json": {"type": "string", "$defs": {
            f"d{i}": {"type": "string"} for i in range(1500)}}}, "guided_json"),
        ("guided_json string 3000 deep", {"guided_json": "[" * 3000 + "]" * 3000}, "guided_json"),
        ("Lark chain of 10000 rules", {"guided_grammar": lark_chain(10_000)}, "guided_grammar"),
        ("Lark chain of 400 rules", {"guided_grammar": lark_chain(400)}, "guided_grammar"),
        ("GBNF chain of 10000 rules", {"structured_outputs": {"grammar": gbnf_chain(10_000)}},
         "structured_outputs.grammar"),
        ("a rule that is only itself", {"guided_grammar": "start: a\na: a"}, "guided_grammar"),
        ("grammar parentheses 5000 deep", {"guided_grammar": "start: " + "(" * 5000 + '"x"' + ")" * 5000},
         "guided_grammar"),
        ("regex parentheses 5000 deep", {"guided_regex": "(" * 5000 + "x" + ")" * 5000}, "guided_regex"),
        ("regex of 50000 alternatives", {"guided_regex": "|".join(f"w{i}" for i in range(50_000))}, "guided_regex"),
    ]
    for index in range(12):
        nodes = rng.choice([3, 10, 50, 400, 1200])
        found.append((f"random $ref graph {index} ({nodes} definitions)", response_format(ref_graph(rng, nodes)),
                      "response_format"))
    return found


def send_all(base_url: str, model: str, seed: int = 0, headers: dict | None = None) -> list[tuple[str, int, dict | None,
                                                                                                  str]]:
    """(case name, status, the error object or None, the field a 400 should name) for every case."""
    answers = []
    with httpx.Client(timeout=180) as client:
        for name, fields, param in cases(seed):
            body = json.dumps({"model": model, "prompt": "x", "max_tokens": 2, **fields})
            response = client.post(f"{base_url}/v1/completions", content=body,
                                   headers={"content-type": "application/json", **(headers or {})})
            error = response.json().get("error") if response.status_code != 200 else None
            answers.append((name, response.status_code, error, param))
    return answers
