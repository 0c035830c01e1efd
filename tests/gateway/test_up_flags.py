"""`lockstep up` takes the gateway's routing and affinity flags, with the gateway's defaults."""

from __future__ import annotations

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
