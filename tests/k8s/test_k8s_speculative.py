"""`spec.speculativeConfig`: the operator turns it into the engine's `--speculative-config` (vLLM's keys), which
`lockstep serve` parses back to the same setting, and refuses what the engine would refuse, naming the field."""

from __future__ import annotations

import json

import pytest

from lockstep_engine.config import speculative_config_arg
from lockstep_engine.entrypoints.serve import build_parser
from lockstep_operator import pods
from lockstep_operator.spec import SpecError, parse_spec

IMAGE = "registry.example/lockstep:9.9.9"


def _spec(speculative, **more):
    return parse_spec("llama", {"model": {"source": "random:tiny"}, "speculativeConfig": speculative, **more},
                      default_image=IMAGE)


@pytest.mark.parametrize("speculative, engine_json", [
    ({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 4, "promptLookupMin": 2},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
    ({"method": "ngram", "numSpeculativeTokens": 5}, {"method": "ngram", "num_speculative_tokens": 5}),
    ({"method": "draft_model", "numSpeculativeTokens": 2, "model": "random:tiny"},
     {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:tiny"}),
])
def test_the_field_becomes_a_flag_the_engine_parses_to_the_same_setting(speculative, engine_json):
    args = pods.engine_args(_spec(speculative))
    value = args[args.index("--speculative-config") + 1]
    assert json.loads(value) == engine_json
    parsed = build_parser().parse_args(args).speculative_config
    assert parsed == speculative_config_arg(json.dumps(engine_json))
    assert parsed.method == engine_json["method"] and parsed.num_speculative_tokens == engine_json["num_speculative_tokens"]


def test_no_field_no_flag():
    spec = parse_spec("llama", {"model": {"source": "random:tiny"}}, default_image=IMAGE)
    assert spec.speculative_config is None and "--speculative-config" not in pods.engine_args(spec)


@pytest.mark.parametrize("speculative, more, field, words", [
    ({"method": "eagle", "numSpeculativeTokens": 3}, {}, "spec.speculativeConfig.method", "ngram or draft_model"),
    ({"method": "ngram"}, {}, "spec.speculativeConfig.numSpeculativeTokens", "required"),
    ({"method": "ngram", "numSpeculativeTokens": 17}, {}, "spec.speculativeConfig.numSpeculativeTokens", "1..16"),
    ({"method": "draft_model", "numSpeculativeTokens": 3}, {}, "spec.speculativeConfig.model", "required"),
    ({"method": "ngram", "numSpeculativeTokens": 3, "model": "smollm2"}, {}, "spec.speculativeConfig.model",
     "only for method draft_model"),
    ({"method": "draft_model", "numSpeculativeTokens": 3, "model": "smollm2", "promptLookupMax": 3}, {},
     "spec.speculativeConfig.promptLookupMax", "only for method ngram"),
    ({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 2, "promptLookupMin": 3}, {},
     "spec.speculativeConfig.promptLookupMin", "at most promptLookupMax"),
    ({"method": "ngram", "numSpeculativeTokens": 3, "numSpeculative": 3}, {}, "spec.speculativeConfig.numSpeculative",
     "not a field"),
    ({"method": "ngram", "numSpeculativeTokens": 3}, {"parallelism": {"tensor": 2, "gpusPerPod": 2}},
     "spec.speculativeConfig", "tensor = pipeline = 1"),
    ("ngram", {}, "spec.speculativeConfig", "must be an object"),
])
def test_what_the_engine_would_refuse_is_refused_naming_the_field(speculative, more, field, words):
    with pytest.raises(SpecError) as error:
        _spec(speculative, **more)
    assert error.value.field == field and words in str(error.value), str(error.value)


def test_extra_args_may_not_repeat_the_flag():
    with pytest.raises(SpecError) as error:
        parse_spec("llama", {"model": {"source": "random:tiny"},
                             "engine": {"extraArgs": ["--speculative-config", '{"method": "ngram"}']}},
                   default_image=IMAGE)
    assert "--speculative-config" in str(error.value)
