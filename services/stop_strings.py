"""Stop strings on streamed text: find the first stop string in text that arrives in pieces, and
release only text that can no longer turn out to be the start of one.

    m = StopMatcher(["\\n\\n", "END"])
    out, hit = m.push("Hello\\n")    # ("Hello", False): "\\n" may start "\\n\\n", so it is held
    out, hit = m.push("\\nmore")     # ("", True): the text is cut before the stop string
    tail = m.flush()                # at the end without a match: the held text

As in OpenAI's API the stop string itself is never part of the output, nor anything after it. When
two stop strings match, the one that starts first wins. Pure: no tokenizer, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.errors import InvalidRequest


MAX_STOP_STRINGS = 16  # documented limits (docs/security.md): stop strings per request ...
MAX_STOP_STRING_CHARS = 256  # ... and characters per stop string


def check_stops(stops: Sequence[str], field: str = "stop") -> tuple[str, ...]:
    """The stop strings, or InvalidRequest naming an empty one or one over the limits."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{field} may hold at most {MAX_STOP_STRINGS} strings; got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequest(f"{field}[{i}] is an empty string; a stop string needs at least one character")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"{field}[{i}] has {len(s)} characters; a stop string may have at most "
                                 f"{MAX_STOP_STRING_CHARS}")
    return tuple(stops)


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = check_stops(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1  # longest held suffix
        self._pending = ""  # text not yet released: a possible start of a stop string
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to release, whether a stop string has now matched)."""
        if self.matched is not None:
            return "", True
        buf = self._pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self._pending = ""
            return buf[:at], True
        keep = self._partial(buf)
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held text, at the end of a sequence that no stop string ended."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
