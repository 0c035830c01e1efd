"""`lockstep up` takes the gateway's routing, affinity and queue flags, with the gateway's defaults, and passes
them to its gateway."""

from __future__ import annotations

import subprocess
import sys

from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.main import build_parser as gateway_parser

from lockstep import up

SHARED = ("--routing", "--session-header", "--session-affinity", "--no-session-affinity", "--saturation-queue-depth",
          "--max-in-flight-per-engine")


def test_up_has_the_gateways_routing_flags_with_its_defaults():
    gateway, stack = gateway_parser(), up.build_parser()
    for flag in SHARED:
        assert flag in stack._option_string_actions, flag
        ours, theirs = stack._option_string_actions[flag], gateway._option_string_actions[flag]
        assert ours.default == theirs.default and ours.choices == theirs.choices, flag
    routing = next(group for group in gateway._action_groups if group.title == "routing")
    assert {name for action in routing._group_actions for name in action.option_strings} <= set(SHARED)


def test_up_passes_routing_flags_to_the_gateway_and_the_rest_to_engines():
    args, engine_args = up.parse_args(["smollm2", "--routing", "round-robin", "--no-session-affinity",
                                       "--session-header", "x-user", "--saturation-queue-depth", "8",
                                       "--max-in-flight-per-engine", "4", "--num-scheduler-steps", "8"])
    assert (args.routing, args.session_affinity, args.session_header) == ("round-robin", False, "x-user")
    assert (args.saturation_queue_depth, args.max_in_flight_per_engine) == (8, 4)
    assert engine_args == ["--num-scheduler-steps", "8"]


def test_up_has_the_gateways_queue_flags_with_its_defaults():
    gateway, stack = gateway_parser(), up.build_parser()
    for flag in ("--max-queue-length", "--queue-timeout"):
        ours, theirs = stack._option_string_actions[flag], gateway._option_string_actions[flag]
        assert (ours.default, ours.type, ours.help) == (theirs.default, theirs.type, theirs.help), flag


def test_up_passes_the_queue_flags_to_its_gateway_and_the_rest_to_engines():
    args, engine_args = up.parse_args(["random:tiny", "--max-queue-length", "7", "--queue-timeout", "2.5",
                                       "--max-num-seqs", "4"])
    assert engine_args == ["--max-num-seqs", "4"]
    config = up.gateway_config(args, ("http://127.0.0.1:8001",), engine_args)
    assert (config.max_queue_length, config.queue_timeout_s) == (7, 2.5)
    assert config.engines == ("http://127.0.0.1:8001",)
    defaults = up.gateway_config(up.parse_args(["random:tiny"])[0], (), [])
    assert (defaults.max_queue_length, defaults.queue_timeout_s) == (GatewayConfig.max_queue_length,
                                                                     GatewayConfig.queue_timeout_s)


def test_up_refuses_an_out_of_range_queue_flag_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "lockstep.cli", "up", "random:tiny", "--queue-timeout", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--queue-timeout=0.0 is out of range: allowed > 0 seconds" in result.stderr
    assert "starting" not in result.stdout + result.stderr
