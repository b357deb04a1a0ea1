"""services/stop_strings.py: stop strings found in text that arrives in pieces."""

import pytest

from services.errors import InvalidRequest
from services.stop_strings import StopMatcher


def feed(stops, pieces):
    """(released text, matched, index of the piece that matched or None)."""
    m = StopMatcher(stops)
    out = []
    for i, p in enumerate(pieces):
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return "".join(out), m.matched, i
    return "".join(out) + m.flush(), None, None


def test_no_stop_releases_everything():
    assert feed(["XYZ"], ["ab", "cX", "Yd"]) == ("abcXYd", None, None)


def test_match_inside_one_piece_cuts_before_it():
    assert feed(["END"], ["hello END world"]) == ("hello ", "END", 0)


def test_match_spanning_rounds():
    assert feed(["\n\n"], ["one\n", "\ntwo"]) == ("one", "\n\n", 1)
    assert feed(["abcd"], ["xa", "b", "c", "dy"]) == ("x", "abcd", 3)


def test_partial_match_is_held_then_released():
    m = StopMatcher(["abc"])
    assert m.push("xab") == ("x", False)  # "ab" may start "abc"
    assert m.push("d") == ("abd", False)  # it did not
    assert m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.push("xab") == ("x", False)
    assert m.flush() == "ab"  # the end: held text is released


def test_stop_at_the_very_start():
    assert feed(["Hi"], ["Hi there"]) == ("", "Hi", 0)
    assert feed(["Hi"], ["H", "i"]) == ("", "Hi", 1)


def test_multiple_stops_the_earliest_wins():
    assert feed(["world", "lo"], ["hello world"]) == ("hel", "lo", 0)
    assert feed(["bc", "abcd"], ["xab", "cd"]) == ("x", "abcd", 1)  # "abcd" starts first
    # a long stop string is held while a shorter one matches later text
    assert feed(["zzzz", "q"], ["azz", "q"]) == ("azz", "q", 1)


def test_overlapping_prefix_retried():
    # "aab" where the stop is "ab": the first "a" is released once it cannot start a match
    assert feed(["ab"], ["a", "a", "b"]) == ("a", "ab", 2)


def test_after_a_match_nothing_more():
    m = StopMatcher(["x"])
    assert m.push("ax") == ("a", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_holds_nothing():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)


def test_empty_stop_string_refused():
    with pytest.raises(InvalidRequest, match=r"stop\[1\] is an empty string"):
        StopMatcher(["ok", ""])
