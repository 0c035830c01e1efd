"""`--api-server-count` on Kubernetes: an LLMService sets it through `spec.engine.extraArgs` (the operator owns
no such field), and the engine pod's command line then runs that many API servers."""

from __future__ import annotations

from lockstep_engine.entrypoints.serve import build_parser
from lockstep_operator import pods
from lockstep_operator.spec import parse_spec


def test_extra_args_carry_the_api_server_count_to_a_command_line_lockstep_serve_takes():
    spec = parse_spec("llama", {"model": {"source": "random:tiny"}, "engine": {"extraArgs": ["--api-server-count", "3"]}},
                      default_image="registry.example/lockstep:9.9.9")
    args = pods.engine_args(spec)
    assert args[-2:] == ["--api-server-count", "3"]
    assert build_parser().parse_args(args).api_server_count == 3
