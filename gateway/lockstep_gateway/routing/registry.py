"""The routing policies by name (`--routing`): each a composition of filters, weighted scorers and the
tie-break the picker uses among equals. A new policy is one module with a `policy()` that returns its
`Policy`, named in the import of the policy modules below and given one line in POLICIES (docs/GATEWAY.md,
"Routing": kv_cache.py is the worked example)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lockstep_gateway.routing import kv_cache  # the policies with a module of their own
from lockstep_gateway.routing.affinity import SessionAffinity
from lockstep_gateway.routing.candidate import Settings
from lockstep_gateway.routing.lora import LoraAffinity
from lockstep_gateway.routing.prefix import PrefixCache
from lockstep_gateway.routing.router import Policy
from lockstep_gateway.routing.scorers import RoundRobin


def least_load() -> Policy:
    """No preference: power of two choices by load over every engine that may take the request."""
    return Policy()


def round_robin() -> Policy:
    return Policy(scorers=((RoundRobin(), 1.0),))


def prefix_aware() -> Policy:
    """The prompt prefix's engine while it is not much busier than the lightest; else least-load."""
    return Policy(scorers=((PrefixCache(), 1.0),))


POLICIES: dict[str, Callable[[], Policy]] = {
    "least-load": least_load,
    "round-robin": round_robin,
    "prefix-aware": prefix_aware,
    "kv-cache": kv_cache.policy,
}


# LoRA affinity's weight in every policy: an engine running the request's adapter counts as much as one
# holding its prompt prefix (an adapter's cached prefix is on the engines that ran it).
LORA_AFFINITY_WEIGHT = 1.0


def build_policy(name: str, settings: Settings) -> Policy:
    """The named policy with LoRA affinity (it scores requests for adapters only); with
    `--session-affinity`, a request with a session key goes to its session's engine whatever the
    policy's other scorers say: affinity outweighs all of them together."""
    policy = POLICIES[name]()
    policy = replace(policy, scorers=((LoraAffinity(), LORA_AFFINITY_WEIGHT), *policy.scorers))
    if not settings.session_affinity:
        return policy
    weight = 1.0 + sum(weight for _, weight in policy.scorers)
    return replace(policy, scorers=((SessionAffinity(settings.session_header), weight), *policy.scorers))
