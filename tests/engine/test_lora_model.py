"""LoRA adapters on the model side: PEFT adapters read from disk, loaded into weight slots of
Lockstep's SmolLM2 and mixed with the base model in one batch, against transformers + peft running
each adapter alone (fp32 on the CPU); the same with tensor parallelism over two gloo processes; and
every malformed adapter refused with a reason."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from lora_cases import BLOCK_SIZE, TP_CONFIG, TP_SCRIPT, prefill_logits, tp_logits, tp_model
from safetensors.torch import save_file

from lockstep_engine.attention import TorchPagedAttention
from lockstep_engine.lora.adapters import AdapterError, module_shapes, read_adapter
from lockstep_engine.lora import model as lora_model
from lockstep_engine.lora.model import ModelLoRA
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.models.llama import LlamaForCausalLM
from lockstep_engine.parallel import SINGLE
from lockstep_engine.sources import SMOLLM2_GGUF, fetch_smollm2

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 198, 2683, 359, 253, 5356, 30],
           [1, 504, 3458, 282, 4649, 314], [1, 1070, 2940, 28, 16, 33]]


@pytest.fixture(scope="module")
def smollm2_with_peft(tmp_path_factory):
    """Lockstep's SmolLM2 (weights from transformers' copy of the GGUF), two PEFT adapters saved to
    disk, and peft's last-position logits of each prompt under the base model and each adapter."""
    from transformers import AutoModelForCausalLM

    path = fetch_smollm2()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    hf.eval()
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = LlamaForCausalLM(config, SINGLE, TorchPagedAttention(config.num_attention_heads,
                                                                 config.num_key_value_heads, config.head_dim,
                                                                 BLOCK_SIZE))
    model.load_weights(hf.state_dict().items())
    adapters = {"every-layer": peft.LoraConfig(r=8, lora_alpha=24, target_modules=ALL_TARGETS,
                                               init_lora_weights=False),
                "attention-rs": peft.LoraConfig(r=4, lora_alpha=6, use_rslora=True, init_lora_weights=False,
                                                target_modules=["q_proj", "v_proj", "down_proj"])}
    torch.manual_seed(0)
    names = list(adapters)
    wrapped = peft.get_peft_model(hf, adapters[names[0]], adapter_name=names[0])
    wrapped.add_adapter(names[1], adapters[names[1]])
    with torch.no_grad():
        for key, param in wrapped.named_parameters():
            if "lora_B" in key:  # not a no-op, and small enough to keep the logits in a sane range
                param.copy_(torch.randn_like(param) * 0.05)
    root = tmp_path_factory.mktemp("adapters")
    expected = {}
    with torch.inference_mode():
        with wrapped.disable_adapter():
            expected[None] = torch.stack([wrapped(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        for name in names:
            wrapped.set_adapter(name)
            expected[name] = torch.stack([wrapped(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    wrapped.save_pretrained(str(root))
    dirs = {name: next(os.path.join(d, "") for d, _, files in os.walk(root)
                       if "adapter_config.json" in files and json.load(open(os.path.join(d, "adapter_config.json")))
                       ["r"] == adapters[name].r) for name in names}
    return model, config, dirs, expected


@pytest.mark.parametrize("path", ["plain", "triton"])
def test_base_and_two_adapters_mixed_in_one_batch_match_peft(smollm2_with_peft, path, monkeypatch):
    """Both LoRA paths: the plain per-slot one, and the grouped Triton kernels CUDA runs (here in
    Triton's CPU interpreter)."""
    if path == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setattr(lora_model, "use_kernels", lambda x: True)
    model, config, dirs, expected = smollm2_with_peft
    before = prefill_logits(model, PROMPTS)
    lora = ModelLoRA(model, max_loras=2, max_rank=16, max_tokens=64, device="cpu", dtype=torch.float32)
    try:
        for slot, name in enumerate(dirs, start=1):
            lora.load(slot, read_adapter(name, dirs[name], config, max_rank=16))
        # no adapter in the batch: the layers leave the base model's output untouched, bit for bit
        lora.set_slots(None)
        assert torch.equal(prefill_logits(model, PROMPTS), before)
        # prompts 0 and 2 are the same tokens, under adapter 1 and under the base model
        first, second = dirs
        names = [first, second, None, first]
        slots = {None: 0, **{name: slot for slot, name in enumerate(dirs, start=1)}}
        per_token = torch.tensor([slots[name] for name, p in zip(names, PROMPTS) for _ in p])
        lora.set_slots(per_token)
        logits = prefill_logits(model, PROMPTS)
        for row, name in enumerate(names):
            ref = expected[name][row]
            assert logits[row].argmax() == ref.argmax(), (row, name)
            torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(logits[0], logits[2], atol=1e-2)  # the adapter changes the logits
        assert torch.equal(logits[2], before[2])  # the base row of a mixed batch is untouched
        # a cleared slot serves the base model again
        lora.clear(1)
        torch.testing.assert_close(prefill_logits(model, PROMPTS)[0], expected[None][0], atol=1e-4, rtol=1e-4)
    finally:
        lora.set_slots(None)
        for layer in lora.layers.values():
            layer.layer.lora = None


def test_tensor_parallel_shards_match_one_rank(tmp_path):
    single = tp_logits(0, 1, None)
    out = tmp_path / "tp2.pt"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = dict(os.environ, LOCKSTEP_CPU_THREADS="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", TP_SCRIPT, __file__, str(rank), port, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    sharded = torch.load(out)
    assert torch.equal(sharded.argmax(-1), single.argmax(-1))
    torch.testing.assert_close(sharded, single, atol=1e-4, rtol=1e-4)



def test_slot_buffers_have_the_designed_size_and_guard_their_slots(tmp_path):
    model, lora = tp_model(0, 1, None)
    # per slot and layer, elements of A [slices * 8, in] and B [out, 8]: qkv (3 slices, out 64 + 8 + 8),
    # o_proj, gate_up (2 slices, out 2 * 128), down_proj; 3 slots, 2 layers, fp32; plus 64 int64 token slots
    per_slot = (3 * 8 * 64 + 80 * 8) + (8 * 64 + 64 * 8) + (2 * 8 * 64 + 256 * 8) + (8 * 128 + 64 * 8)
    assert lora.nbytes == per_slot * 3 * 2 * 4 + 64 * 8
    adapter = read_adapter("fine", write_adapter(tmp_path), TP_CONFIG, max_rank=8)
    for slot in (0, 3):
        with pytest.raises(ValueError, match=f"LoRA slot {slot} is out of range"):
            lora.load(slot, adapter)
    with pytest.raises(ValueError, match="65 tokens exceed the LoRA slot buffer of 64"):
        lora.set_slots(torch.ones(65, dtype=torch.int64))


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda_only
def test_cuda_kernels_match_the_cpu_path_and_capture_in_a_graph():
    """The grouped Triton path on CUDA gives the CPU plain path's logits; slots copied from a device tensor (no
    host sync) inside a CUDA graph capture steer each replay."""
    from lockstep_engine.lora.ops import add_lora_plain

    cpu = tp_logits(0, 1, None)
    gpu = tp_logits(0, 1, None, device="cuda")
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-3, rtol=1e-3)
    model, lora = tp_model(0, 1, None, device="cuda", dtype=torch.bfloat16)
    layer = model.model.layers["1"].self_attn.qkv_proj
    x = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(6, dtype=torch.int64, device="cuda")
    with torch.inference_mode():
        lora.set_slots(slots)
        layer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lora.set_slots(slots)
            y = layer(x)
        for values in ([1, 2, 0, 2, 1, 1], [2] * 6):
            slots.copy_(torch.tensor(values))
            graph.replay()
            expected = torch.nn.functional.linear(x, layer.weight)
            add_lora_plain(x, expected, layer.lora.a, layer.lora.b, slots, sorted(set(values) - {0}), layer.lora.slices)
            torch.testing.assert_close(y.float(), expected.float(), atol=5e-2, rtol=5e-2)


def write_adapter(directory, rank=4, targets=("q_proj", "down_proj"), layers=(0, 1), config=None, tensors=None):
    """A PEFT-layout adapter for TP_CONFIG's model; `config` and `tensors` override or add entries."""
    shapes = module_shapes(TP_CONFIG)
    weights = {}
    for layer in layers:
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            size_in, size_out = shapes[module]
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, size_in)
            weights[f"{prefix}.lora_B.weight"] = torch.randn(size_out, rank)
    weights.update(tensors or {})
    os.makedirs(directory, exist_ok=True)
    save_file({k: v for k, v in weights.items() if v is not None}, os.path.join(directory, "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(targets), "bias": "none",
              "use_dora": False, "base_model_name_or_path": "tiny", **(config or {})}
    with open(os.path.join(directory, "adapter_config.json"), "w") as handle:
        json.dump(fields, handle)
    return str(directory)


def test_a_well_formed_adapter_reads_with_its_scale(tmp_path):
    adapter = read_adapter("fine", write_adapter(tmp_path, config={"use_rslora": True}), TP_CONFIG, max_rank=8)
    assert (adapter.rank, adapter.scale) == (4, 8 / 2)
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    a, b = adapter.weights[(1, "down_proj")]
    assert (a.shape, b.shape, a.dtype) == ((4, 128), (64, 4), torch.float32)
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def _truncate(directory):
    path = os.path.join(directory, "adapter_model.safetensors")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 100)


def _remove(name):
    return lambda directory: os.remove(os.path.join(directory, name))


PREFIX = "base_model.model.model.layers.0"
MALFORMED = {
    "rank above max": (dict(rank=16), None, "rank 16 exceeds max_lora_rank=8"),
    "DoRA": (dict(config={"use_dora": True}), None, "DoRA adapters are not supported"),
    "unknown target": (dict(config={"target_modules": ["q_proj", "embed_tokens"]}), None,
                       "unsupported target 'embed_tokens'"),
    "unknown tensor": (dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), None,
                       "'base_model.model.lm_head.lora_A.weight': unsupported"),
    "tensor outside target_modules": (dict(targets=("q_proj", "k_proj"), config={"target_modules": ["q_proj"]}),
                                      None, "k_proj is not in target_modules"),
    "wrong shape": (dict(tensors={f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 65)}), None,
                    "shape [4, 65] does not match the base model (expected [4, 64] for rank 4)"),
    "layer out of range": (dict(layers=(0, 2)), None, "layer 2 is out of range (the model has 2 layers)"),
    "A without B": (dict(tensors={f"{PREFIX}.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)},
                         targets=("q_proj",), config={"target_modules": ["q_proj", "up_proj"]}), None,
                    "layer 0 up_proj has no lora_B weight"),
    "bias": (dict(config={"bias": "lora_only"}), None, "bias: 'lora_only' is not supported"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), None, "modules_to_save: ['lm_head']"),
    "LoRA bias": (dict(config={"lora_bias": True}), None, "lora_bias: True is not supported"),
    "missing config": (dict(), _remove("adapter_config.json"), "adapter_config.json: missing"),
    "missing weights": (dict(), _remove("adapter_model.safetensors"), "adapter_model.safetensors: missing"),
    "truncated weights": (dict(), _truncate, "adapter_model.safetensors: not a valid safetensors file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_adapter_is_refused_with_the_reason(tmp_path, case):
    kwargs, damage, reason = MALFORMED[case]
    directory = write_adapter(tmp_path / "bad", **kwargs)
    if damage:
        damage(directory)
    with pytest.raises(AdapterError) as error:
        read_adapter("bad-one", directory, TP_CONFIG, max_rank=8)
    assert "'bad-one'" in str(error.value) and reason in str(error.value), str(error.value)


def test_adapter_file_over_the_size_bound_is_refused(tmp_path):
    directory = write_adapter(tmp_path)
    size = os.path.getsize(os.path.join(directory, "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=f"{size} bytes exceeds the bound of 1000 bytes"):
        read_adapter("big", directory, TP_CONFIG, max_rank=8, max_bytes=1000)
    with pytest.raises(AdapterError, match="is not a directory"):
        read_adapter("nowhere", str(tmp_path / "absent"), TP_CONFIG, max_rank=8)
