"""Speculative decoding inside multi-step windows (vLLM's --speculative-config): the proposers (n-gram
prompt lookup, a draft model) and the acceptance rule. The window loop that runs them is
`runner.spec_window`; everything here works on device tensors, with no host sync."""
