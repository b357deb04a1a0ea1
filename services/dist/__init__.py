"""Tensor-parallel verifier groups: process groups with deadlines (group.py), the rank-0 proxy and
the worker loop (proxy.py), and the executors that start the ranks (local processes, Ray actors)."""
