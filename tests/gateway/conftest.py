"""The distributed fixtures (tests/pipeline.py)."""

from tests.pipeline import model_dirs, redis_url, text_model_dirs  # noqa: F401
