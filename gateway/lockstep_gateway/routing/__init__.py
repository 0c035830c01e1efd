"""Which engine takes a request, decided as the Gateway API Inference Extension's endpoint picker does:

* filters (filters.py) drop the engines that may not take it: down, not serving the model, breaker open,
  suspect while others answer, already tried, saturated;
* scorers (scorers.py, prefix.py, affinity.py, kv_cache.py, lora.py) score each remaining engine from 0 to 1;
* the picker (picker.py) takes the highest weighted sum, and among equals draws two and keeps the lighter.

A policy (router.py) names its scorers, their weights and its tie-break; registry.py maps `--routing`
names to policies. Everything here is plain data and pure decisions but the stateful scorers' memory
(the prefix index, the affinity rings, the round-robin turn); candidate.py holds the snapshot types.
"""
