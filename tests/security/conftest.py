"""Fixtures of the security tests (tests/pipeline.py): tiny model directories and a real Redis."""

from tests.pipeline import model_dirs, redis_url, text_model_dirs  # noqa: F401
