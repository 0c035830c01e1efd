"""Bad input raises an error naming the field, the value and the allowed range."""

import pytest

from lockstep_engine.config import ConfigError, EngineConfig
from lockstep.bench import throughput as bench_throughput
from lockstep_engine.entrypoints import generate, serve
from lockstep_engine.sampling_params import SamplingParams, SamplingParamsError
from lockstep_engine.sources import ModelSourceError, resolve


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"max_tokens": -1}, "max_tokens", "positive integer"),
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"temperature": -0.5}, "temperature", "[0, 100]"),
    ({"top_k": -3}, "top_k", "positive integer"),
    ({"min_p": 2.0}, "min_p", "[0, 1]"),
    ({"n": 0}, "n", "[1, 128]"),
    ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "(0, 2]"),
    ({"logprobs": 50}, "logprobs", "[0, 20]"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "at most max_tokens"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"logit_bias": {5: 500.0}}, "logit_bias", "[-100, 100]"),
])
def test_sampling_params_errors_name_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**kwargs)
    message = str(error.value)
    assert error.value.param == field and message.startswith(f"{field}=") and allowed in message


@pytest.mark.parametrize("kwargs, field", [
    ({"num_scheduler_steps": 0}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 65}, "num_scheduler_steps"),
    ({"num_scheduler_steps": "fast"}, "num_scheduler_steps"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 7}, "block_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"device": "tpu"}, "device"),
    ({"scheduling_policy": "sjf"}, "scheduling_policy"),
    ({"lof_max_wait_s": -1.0}, "lof_max_wait_s"),
    ({"lof_max_wait_s": float("nan")}, "lof_max_wait_s"),
])
def test_engine_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        EngineConfig(model="random:tiny", **kwargs)


def test_auto_steps_accepted():
    assert EngineConfig(model="random:tiny", num_scheduler_steps="auto").is_adaptive
    assert EngineConfig(model="random:tiny", num_scheduler_steps="16").num_scheduler_steps == 16


@pytest.mark.parametrize("build_parser, argv", [
    (serve.build_parser, ["smollm2", "--num-scheduler-steps", "many"]),
    (generate.build_parser, ["smollm2", "--prompt", "hi", "--num-scheduler-steps", "many"]),
    (bench_throughput._parser, ["smollm2", "--num-scheduler-steps", "8", "many"]),
])
def test_num_scheduler_steps_flag_error_names_flag_value_and_range(build_parser, argv, capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    assert "error: argument --num-scheduler-steps: 'many' is invalid: expected an integer in [1, 64] or 'auto'" \
        in capsys.readouterr().err


def test_num_scheduler_steps_flag_parses_counts_and_auto():
    args = bench_throughput._parser().parse_args(["smollm2", "--num-scheduler-steps", "1", "16", "auto"])
    assert args.num_scheduler_steps == [1, 16, "auto"]


@pytest.mark.parametrize("spec, fragment", [
    ("random:giant", "unknown random shape 'giant'"),
    ("nosuchmodel", "is not a known source"),
    ("/tmp/does-not-exist.gguf", "no such file"),
])
def test_unknown_model_spec(spec, fragment):
    with pytest.raises(ModelSourceError, match=fragment):
        resolve(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match="not a readable GGUF file"):
        resolve(str(bad))


def test_prompt_errors(tiny):
    engine = tiny.engine
    limit = engine.config.max_model_len
    with pytest.raises(SamplingParamsError, match="prompt=.*fewer than max_model_len"):
        engine.add_request([5] * limit, SamplingParams())
    with pytest.raises(SamplingParamsError, match=r"prompt=5000 .*token ids in \[0, 1024\)"):
        engine.add_request([1, 5000], SamplingParams())
    with pytest.raises(SamplingParamsError, match="prompt=.*at least one token"):
        engine.add_request([], SamplingParams())
    with pytest.raises(SamplingParamsError, match="max_tokens=.*max_model_len"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=limit))
    with pytest.raises(SamplingParamsError, match="stop_token_ids=4096"):
        engine.add_request([1, 2, 3], SamplingParams(stop_token_ids=[4096]))
    with pytest.raises(ValueError, match="has no tokenizer"):
        engine.add_request("text prompt", SamplingParams())
    assert not engine.has_unfinished_requests()


def test_layout_rejected_by_model():
    from lockstep_engine.parallel import stage_layers

    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds the model's 4 layers"):
        stage_layers(4, 0, 5)


def test_scheduling_policy_flag_takes_fcfs_or_lof(capsys):
    assert serve.build_parser().parse_args(["smollm2", "--scheduling-policy", "lof"]).scheduling_policy == "lof"
    assert bench_throughput._parser().parse_args(["smollm2"]).scheduling_policy == "lof"
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["smollm2", "--scheduling-policy", "sjf"])
    assert "argument --scheduling-policy: invalid choice: 'sjf'" in capsys.readouterr().err
