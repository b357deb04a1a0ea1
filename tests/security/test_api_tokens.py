"""API tokens rotate without a restart (services/rpc/api_tokens.py): the file is read again when it
changes; a change that cannot be applied keeps the tokens in force. Files are replaced by rename (a
new inode, as Kubernetes' Secret update and `mv` do), so no test depends on timestamp granularity."""

import logging
import os

import pytest

from services.rpc.api_tokens import ApiTokens
from services.rpc.config import ConfigError
from services.rpc.security import token_identity

ALICE, ALICE2, BOB = "alice-token-0123456789", "alice-token-rotated-0123", "bob-token-0123456789abc"


def replace(path, text: str) -> None:
    new = path.with_suffix(".new")
    new.write_text(text)
    os.replace(new, path)


def test_a_rotated_file_applies_at_the_next_lookup(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text(f"# identity token\nalice {ALICE}\nbob {BOB}\n")
    tokens = ApiTokens.from_file(str(path))
    assert token_identity(ALICE, tokens) == "alice" and token_identity(BOB, tokens) == "bob"
    replace(path, f"alice {ALICE2}\n")
    with caplog.at_level(logging.WARNING, "aerie.security"):
        assert token_identity(ALICE, tokens) is None and token_identity(BOB, tokens) is None
    assert token_identity(ALICE2, tokens) == "alice" and tokens.reloads == 1
    assert "reloaded: 1 tokens for 1 identities (added: none; removed: bob)" in caplog.text
    assert ALICE2 not in caplog.text and ALICE2 not in repr(tokens)  # tokens are never logged


@pytest.mark.parametrize("change", ["invalid", "empty", "short", "removed"])
def test_a_change_that_cannot_apply_keeps_the_tokens_in_force(tmp_path, caplog, change):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE}\n")
    tokens = ApiTokens.from_file(str(path))
    if change == "removed":
        path.unlink()
    else:
        replace(path, {"invalid": "alice\n", "empty": "# nothing\n", "short": "alice abc\n"}[change])
    with caplog.at_level(logging.ERROR, "aerie.security"):
        assert token_identity(ALICE, tokens) == "alice"
    reason = {"invalid": "line 1: expected 'identity token'", "empty": "it holds no token",
              "short": "shorter than 16 characters", "removed": "the file is gone"}[change]
    assert "changed but is not applied" in caplog.text and reason in caplog.text
    assert "the 1 tokens loaded before stay in force" in caplog.text
    caplog.clear()
    assert token_identity(ALICE, tokens) == "alice" and not caplog.text  # logged once per change
    replace(path, f"alice {ALICE2}\n")  # fixed: applied
    assert token_identity(ALICE2, tokens) == "alice" and token_identity(ALICE, tokens) is None


def test_tokens_added_in_process_survive_a_reload(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE}\n")
    tokens = ApiTokens.from_file(str(path))
    tokens["gateway-own-token-0123456789"] = "gateway"  # what coordinator.server.with_gateway_token does
    replace(path, f"bob {BOB}\n")
    assert dict(tokens) == {BOB: "bob", "gateway-own-token-0123456789": "gateway"} and len(tokens) == 2


def test_an_unreadable_file_at_start_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read AERIE_API_TOKENS_FILE"):
        ApiTokens.from_file(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("alice\n")
    with pytest.raises(ConfigError, match="line 1: expected 'identity token'"):
        ApiTokens.from_file(str(tmp_path / "bad"))
