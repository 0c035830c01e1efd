"""`lockstep serve` flags (vLLM's names) and the small `generate` / `fetch` commands."""

import json

import pytest

from lockstep.cli import main as lockstep_main
from lockstep_engine.entrypoints import serve


def test_serve_takes_vllm_flag_names():
    args, config, settings = serve.parse_args([
        "smollm2", "--host", "127.0.0.1", "--port", "9000", "--num-scheduler-steps", "auto",
        "--max-num-seqs", "32", "--max-model-len", "512", "--max-num-batched-tokens", "1024",
        "--gpu-memory-utilization", "0.5", "--served-model-name", "small", "alias", "--api-key", "k",
        "--dtype", "bfloat16", "--seed", "7", "--device", "cpu", "--block-size", "32",
        "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching"])
    assert (args.host, args.port) == ("127.0.0.1", 9000)
    assert config.num_scheduler_steps == "auto" and config.max_num_seqs == 32 and config.max_model_len == 512
    assert config.max_num_batched_tokens == 1024 and config.gpu_memory_utilization == 0.5
    assert (config.dtype, config.seed, config.device, config.block_size) == ("bfloat16", 7, "cpu", 32)
    assert config.num_gpu_blocks_override == 100 and config.enable_prefix_caching is False
    assert settings.served_model_names == ["small", "alias"] and settings.api_key == "k"


@pytest.mark.parametrize("flags", [["--num-scheduler-steps", "0"], ["--num-scheduler-steps", "many"],
                                   ["--max-num-seqs", "0"], ["--block-size", "7"], ["--dtype", "int3"],
                                   ["--tensor-parallel-size", "0"]])
def test_serve_refuses_bad_flags_by_name(flags, capsys):
    with pytest.raises(SystemExit) as caught:
        serve.parse_args(["smollm2", *flags])
    assert caught.value.code == 2
    assert flags[0].lstrip("-").replace("-", "_") in capsys.readouterr().err.replace("-", "_")


def test_generate_prints_json(capsys):
    assert lockstep_main(["generate", "smollm2", "--prompt", "The capital of France is", "--max-tokens", "4",
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"].startswith(" Paris") and result["completion_tokens"] == 4


def test_generate_without_a_tokenizer_fails_cleanly(capsys):
    assert lockstep_main(["generate", "random:tiny", "--prompt", "hi"]) == 1
    assert "tokenizer" in capsys.readouterr().err


def test_fetch_smollm2_prints_the_cached_file(capsys):
    assert lockstep_main(["fetch", "smollm2"]) == 0
    assert capsys.readouterr().out.strip().endswith(".gguf")
