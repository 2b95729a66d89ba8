"""Workloads: one module per workload (score, classify, embed, beam), each with its request type,
its CPU prepare/finish stages and its pipeline, found by `registry.workloads()`."""
