"""Freight benchmarks: workload generators and the systems they are run on (see bench/README.md)."""
