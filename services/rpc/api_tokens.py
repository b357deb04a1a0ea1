"""The public API's tokens (AERIE_API_TOKENS_FILE), read again when the file changes: rotation without
a restart.

    tokens = ApiTokens.from_file(path)    # ConfigError if it cannot be read or parsed at start
    tokens.get(token)                     # -> identity; checks the file first
    tokens["<in-process token>"] = "gateway"   # kept across reloads (the in-process gateway's own)

Every lookup first compares the file's (inode, size, mtime) with those it last read: an editor's save,
`mv new tokens` and Kubernetes' update of a mounted Secret (an atomic symlink swap) all change them,
and the next request sees the new tokens. One `stat` per lookup, no thread, no timer. An identity keeps
its sequences when its token changes (ownership is by identity, docs/security.md).

A changed file that cannot be read, does not parse or holds no token is not applied: the tokens last
loaded stay in force and the error is logged once per change, so a half-written file or a mistake never
locks every caller out (or lets every caller in). Removing the file does the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, MutableMapping

from services.rpc.config import ConfigError

log = logging.getLogger("aerie.security")
MIN_TOKEN_CHARS = 16  # an API token shorter than this is refused (guessable)


def parse_tokens(text: str) -> dict[str, str]:
    """`identity token` per line (# comments, blank lines) -> {token: identity}."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"API tokens file line {n}: expected 'identity token'")
        identity, token = parts
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"API tokens file line {n}: the token of {identity!r} is shorter than "
                              f"{MIN_TOKEN_CHARS} characters")
        out[token] = identity
    return out


def _signature(path: str) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or rewritten (follows symlinks); None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class ApiTokens(MutableMapping[str, str]):
    """token -> identity, from a file read again when it changes, plus tokens added in process."""

    def __init__(self, path: str, tokens: dict[str, str], signature: tuple[int, int, int] | None) -> None:
        self.path = path
        self._file = tokens  # what the file held when last applied
        self._added: dict[str, str] = {}  # set in process (`tokens[t] = identity`): survive reloads
        self._seen = signature  # the file's signature when last read (applied or not)
        self.reloads = 0  # times a changed file was applied

    @classmethod
    def from_file(cls, path: str) -> ApiTokens:
        """Read at start: here an unreadable or invalid file is a ConfigError (the process does not start)."""
        signature = _signature(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read AERIE_API_TOKENS_FILE ({e.strerror})") from None
        return cls(path, parse_tokens(text), signature)

    def refresh(self) -> bool:
        """Apply the file if it changed since it was last read; True when new tokens were applied."""
        signature = _signature(self.path)
        if signature == self._seen:
            return False
        self._seen = signature
        try:
            if signature is None:
                raise ConfigError("the file is gone")
            with open(self.path, encoding="utf-8") as f:
                tokens = parse_tokens(f.read())
            if not tokens:
                raise ConfigError("it holds no token")
        except (OSError, ConfigError, UnicodeDecodeError) as e:
            log.error("AERIE_API_TOKENS_FILE %s changed but is not applied (%s): the %d tokens loaded before "
                      "stay in force", self.path, getattr(e, "strerror", None) or e, len(self._file))
            return False
        before = set(self._file.values())
        self._file = tokens
        self.reloads += 1
        after = set(tokens.values())
        log.warning("AERIE_API_TOKENS_FILE %s reloaded: %d tokens for %d identities (added: %s; removed: %s)",
                    self.path, len(tokens), len(after), ", ".join(sorted(after - before)) or "none",
                    ", ".join(sorted(before - after)) or "none")
        return True

    def _current(self) -> dict[str, str]:
        self.refresh()
        return {**self._file, **self._added}

    def __getitem__(self, token: str) -> str:
        return self._current()[token]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def items(self):  # one stat and one snapshot for a whole scan (token_identity compares every token)
        return self._current().items()

    def __setitem__(self, token: str, identity: str) -> None:
        self._added[token] = identity

    def __delitem__(self, token: str) -> None:
        del self._added[token]

    def __repr__(self) -> str:  # never the tokens
        return f"ApiTokens({self.path!r}, {len(self._file)} from the file, {len(self._added)} added)"
