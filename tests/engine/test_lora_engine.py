"""LoRA adapters through the whole engine (scheduler, windows, runner): the base model and two PEFT
adapters mixed in one batch give transformers + peft's greedy tokens at N=1 and N=8, with two slots and
with one (the adapters then take turns), and an adapter's KV blocks never serve the base model."""

from __future__ import annotations

import pytest

from lockstep_engine.config import ConfigError, EngineConfig
from lockstep_engine.llm import LLM
from lockstep_engine.runner.cuda_graphs import DecodeGraphs
from lockstep_engine.sampling_params import SamplingParams

pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lora_llm(peft_reference) -> LLM:
    modules = tuple(peft_reference.dirs.items())
    return LLM("smollm2", num_scheduler_steps=1, kv_cache_memory_bytes=256 << 20, enable_lora=True, max_loras=2,
               lora_modules=modules)


def _mixed(llm: LLM, reference) -> None:
    names = [None, *reference.dirs]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [name for _ in PROMPTS for name in names]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), lora_request=loras)
    tokenizer = llm.tokenizer
    differs = 0
    for prompt, name, output in zip(prompts, loras, outputs):
        expected = reference.greedy(tokenizer.encode(prompt), name, NEW_TOKENS)
        assert output.outputs[0].token_ids == expected, (prompt, name)
        differs += name is not None and expected != reference.greedy(tokenizer.encode(prompt), None, NEW_TOKENS)
    assert differs >= 2  # the adapters change the text: the comparison could fail


@pytest.mark.parametrize("steps", [1, 8])
def test_the_base_model_and_two_adapters_mixed_in_one_batch_give_peft_greedy_text(lora_llm, peft_reference, steps):
    llm = lora_llm if steps == 1 else LLM("smollm2", share_model_with=lora_llm, num_scheduler_steps=steps,
                                          kv_cache_memory_bytes=256 << 20, enable_lora=True, max_loras=2,
                                          lora_modules=tuple(peft_reference.dirs.items()))
    _mixed(llm, peft_reference)


def test_decode_graph_replays_with_adapters_give_the_same_text(lora_llm, peft_reference):
    """The graphs' static buffers (run eagerly on the CPU: `DecodeGraphs(capture=False)`): windows with
    adapter rows replay their own graphs, fed each row's slot, and give peft's tokens."""
    llm = LLM("smollm2", share_model_with=lora_llm, num_scheduler_steps=8, kv_cache_memory_bytes=256 << 20,
              enable_lora=True, max_loras=2, lora_modules=tuple(peft_reference.dirs.items()))
    runner = llm.engine.executor.runner
    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    try:
        _mixed(llm, peft_reference)
        assert {key[3] for key in runner.graphs.graphs} == {True}  # every decode window had adapter rows
        assert runner.graphs.capture_lora_twins() == 0
    finally:
        runner.graphs = None


def test_with_one_slot_the_adapters_take_turns_and_the_text_is_the_same(lora_llm, peft_reference):
    llm = LLM("smollm2", share_model_with=lora_llm, num_scheduler_steps=4, kv_cache_memory_bytes=256 << 20,
              enable_lora=True, max_loras=1, lora_modules=tuple(peft_reference.dirs.items()))
    _mixed(llm, peft_reference)


def test_an_adapters_prefix_blocks_never_serve_the_base_model(lora_llm, peft_reference):
    llm = LLM("smollm2", share_model_with=lora_llm, num_scheduler_steps=4, kv_cache_memory_bytes=256 << 20,
              enable_lora=True, max_loras=2, lora_modules=tuple(peft_reference.dirs.items()))
    prompt = "Summarise in one sentence: " + "the printing press spread across Europe quickly. " * 8
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    adapter = next(iter(peft_reference.dirs))
    first = llm.generate(prompt, greedy, lora_request=adapter)[0]
    base = llm.generate(prompt, greedy)[0]
    again = llm.generate(prompt, greedy, lora_request=adapter)[0]
    assert base.num_cached_tokens == 0 and again.num_cached_tokens > 0
    ids = llm.tokenizer.encode(prompt)
    assert base.outputs[0].token_ids == peft_reference.greedy(ids, None, NEW_TOKENS)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == peft_reference.greedy(ids, adapter, NEW_TOKENS)


def test_every_sample_of_an_n_request_runs_with_its_adapter(lora_llm, peft_reference):
    adapter = next(iter(peft_reference.dirs))
    out = lora_llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS), lora_request=adapter)[0]
    expected = peft_reference.greedy(lora_llm.tokenizer.encode(PROMPTS[0]), adapter, NEW_TOKENS)
    assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_lora_configuration_errors_name_the_field():
    with pytest.raises(ConfigError, match="max_lora_rank=12 is invalid: expected one of 1, 8, 16"):
        EngineConfig(model="random:tiny", enable_lora=True, max_lora_rank=12)
    with pytest.raises(ConfigError, match="max_loras=0 is invalid"):
        EngineConfig(model="random:tiny", enable_lora=True, max_loras=0)
    with pytest.raises(ConfigError, match="without enable_lora"):
        EngineConfig(model="random:tiny", lora_modules=(("a", "/a"),))
    with pytest.raises(ConfigError, match="lora_modules='a' is invalid: expected each adapter name once"):
        EngineConfig(model="random:tiny", enable_lora=True, lora_modules=(("a", "/a"), ("a", "/b")))
    with pytest.raises(ConfigError, match="max_cpu_loras=1 is invalid"):
        EngineConfig(model="random:tiny", enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_an_unusable_adapter_fails_the_start_with_its_reason(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], '
                                                  '"use_dora": true}')
    with pytest.raises(ValueError, match="DoRA|dora"):
        LLM("random:tiny", enable_lora=True, lora_modules=(("broken", str(tmp_path)),), num_gpu_blocks_override=64)
