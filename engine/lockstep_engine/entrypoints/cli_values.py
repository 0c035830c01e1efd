"""vLLM's value syntaxes for `lockstep serve` flags (`32k`, `1M`, JSON lists and objects) and `--config FILE`.

Nothing here imports vLLM or torch; the names and rules follow vllm/engine/arg_utils.py (v0.11).
"""

from __future__ import annotations

import argparse
import json
import re


# ---- value syntaxes ---------------------------------------------------------------------------
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's integer syntax (vllm/engine/arg_utils.py `human_readable_int`): lowercase suffixes are
    decimal (25.6k = 25600, 1m = 1000000), uppercase binary and whole (1K = 1024, 2M = 2097152)."""
    value = text.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: decimals are not allowed with binary suffixes "
                                             f"like {suffix}; did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: expected an integer, optionally with k/m/g/t (x1000) or K/M/G/T (x1024)") from None


def json_list(text: str) -> list[str]:
    """vLLM's CORS flags take a JSON list (`'["https://a.example"]'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a JSON list of strings") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a JSON list of strings")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a JSON object")
    return value


# ---- --config FILE ------------------------------------------------------------------------------
def config_file_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Expands `--config FILE` (YAML, keys = flag names without --, as vLLM's FlexibleArgumentParser):
    the file's flags go first, so flags on the command line override them."""
    path, rest = None, []
    items = iter(argv)
    for arg in items:
        if arg == "--config":
            path = next(items, None)
            if path is None:
                parser.error("argument --config: expected a YAML file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if path is None:
        return argv
    import yaml

    try:
        with open(path) as handle:
            loaded = yaml.safe_load(handle)
    except OSError as error:
        parser.error(f"argument --config: cannot read {path}: {error.strerror}")
    except yaml.YAMLError as error:
        parser.error(f"argument --config: {path} is not valid YAML: {error}")
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        parser.error(f"argument --config: {path} must hold a mapping of flag names to values")
    known = parser._option_string_actions
    from_file: list[str] = []
    for key, value in loaded.items():
        name = "--" + str(key).replace("_", "-")
        if key in ("model", "model_tag"):
            continue  # the positional MODEL, below
        if name not in known:
            parser.error(f"argument --config: {path}: unknown flag {key!r}")
        if isinstance(value, bool):
            if value:
                from_file.append(name)
            elif "--no-" + name[2:] in known:
                from_file.append("--no-" + name[2:])
        elif isinstance(value, list):
            from_file += [name, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            from_file += [name, json.dumps(value)]
        elif value is not None:
            from_file += [name, str(value)]
    model = [str(loaded.get("model", loaded.get("model_tag")))] if loaded.get("model", loaded.get("model_tag")) else []
    if rest and not rest[0].startswith("-"):
        return [rest[0], *from_file, *rest[1:]]  # the command line's MODEL wins
    return [*model, *from_file, *rest]


def lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value, as vLLM takes it: `name=path`, or a JSON object with `name` and `path` (and
    an optional `base_model_name`, which names the served model and is not needed here)."""
    value = text.strip()
    if value.startswith("{"):
        try:
            data = json.loads(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid JSON: {error}") from None
        if not (isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("path"), str)
                and data["name"] and data["path"]):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a JSON object with name and path strings")
        return data["name"], data["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected name=path or a JSON object with name and "
                                         f"path")
    return name, path
