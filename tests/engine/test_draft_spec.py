"""`--draft`'s keywords -> DraftSpec (head, retrieval); the head directory it resolves to."""

import pytest

from services.engine.local import DEFAULT_HEAD, DraftSpec, resolve_draft


@pytest.mark.parametrize("draft, head, retrieval", [
    (None, "auto", False), ("auto", "auto", False), ("eagle", "auto", False), ("EAGLE", "auto", False),
    ("none", None, False), ("sam", None, True), ("eagle+sam", "auto", True), ("/h/dir", "/h/dir", False),
    ("/h/dir+sam", "/h/dir", True),
])
def test_draft_keywords(draft, head, retrieval):
    assert DraftSpec.parse(draft) == DraftSpec(head, retrieval)


def test_auto_is_the_shipped_head_for_the_default_model_only():
    assert resolve_draft("auto", None) == (str(DEFAULT_HEAD) if (DEFAULT_HEAD / "config.json").is_file() else None)
    assert resolve_draft("auto", "/some/other/target") is None
    assert resolve_draft("sam", None) is None and resolve_draft("/h/dir+sam", None) == "/h/dir"
