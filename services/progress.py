"""Progress of the slow one-time jobs (cost calibration, GGUF conversion, Hub downloads) on stderr.

    with phase("converting x.gguf once to fp32 safetensors in DIR"):   # "aerie: converting ... ..."
        ...                                                              # "aerie: ... done in 4.2 s"
    tick = counter("timed forwards", 72); tick(); tick() ...            # "\\r... 2/72" on a terminal

Shown when stderr is a terminal, or when AERIE_PROGRESS=1 (a log file, a pod); AERIE_PROGRESS=0
silences it. Never on stdout (that is the command's output, e.g. `aerie generate --json`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def enabled() -> bool:
    value = os.environ.get("AERIE_PROGRESS", "")
    if value in ("0", "1"):
        return value == "1"
    return sys.stderr.isatty()


def note(text: str) -> None:
    if enabled():
        print(f"aerie: {text}", file=sys.stderr, flush=True)


@contextmanager
def phase(text: str) -> Iterator[None]:
    """Announce a phase, then how long it took (not when it raised: the error says why)."""
    note(f"{text} ...")
    t0 = time.perf_counter()
    yield
    note(f"{text}: done in {time.perf_counter() - t0:.1f} s")


def counter(what: str, total: int) -> Callable[[], None]:
    """A callable that counts one more of `total` on one rewritten terminal line (a no-op unless
    stderr is a terminal: in a log a line per count would drown the rest)."""
    done = 0
    live = enabled() and sys.stderr.isatty()

    def tick() -> None:
        nonlocal done
        done += 1
        if live:
            end = "\n" if done >= total else ""
            print(f"\raerie:   {what}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    return tick
