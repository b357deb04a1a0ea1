"""Fixtures of the tensor-parallel service tests (tests/pipeline.py): tiny model directories and a
real Redis per module."""

from tests.pipeline import model_dirs, redis_url  # noqa: F401
