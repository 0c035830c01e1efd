"""Benchmark clients and workloads; standard library and httpx only, never torch."""
