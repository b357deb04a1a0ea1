"""Fixtures of the distributed tests (tests/pipeline.py): tiny model directories (session) and a real
Redis per test module."""

from tests.pipeline import model_dirs, redis_url  # noqa: F401
