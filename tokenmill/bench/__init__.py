"""Benchmark-first tooling: workloads, a load generator, an offline runner, metric math, reports,
and a transformers reference server. See docs/benchmarking.md."""
