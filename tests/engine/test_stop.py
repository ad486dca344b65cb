"""Stop strings: matches across token boundaries, the held-back tail, chunking independence."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.engine.stop import StopStringDetector, check_stop, find_stop, partial_stop_len


def stream(pieces, stops, include=False):
    det = StopStringDetector(stops, include)
    shown = []
    for piece in pieces:
        update = det.feed(piece)
        shown.append(update.delta)
        if update.stopped:
            break
    else:
        shown.append(det.finish())
    return det, shown


def test_stop_string_spanning_token_boundaries():
    det, shown = stream(["Hel", "lo W", "or", "ld"], ["o Wo"])
    assert det.stopped and det.stop == "o Wo" and det.text == "Hell"
    assert "".join(shown) == "Hell"
    assert shown == ["Hel", "l", ""]  # "o W" was held back, then dropped with the stop


def test_include_stop_str_in_output_cuts_after_the_stop():
    det, shown = stream(["Hel", "lo W", "orld"], ["o Wo"], include=True)
    assert det.text == "Hello Wo" and "".join(shown) == "Hello Wo"
    assert shown == ["Hel", "lo W", "o"]  # nothing is held back in this mode


def test_held_back_tail_is_released_when_it_cannot_be_a_stop():
    det = StopStringDetector(["World!"])
    assert det.feed("Hello W").delta == "Hello "
    assert det.feed("or").delta == ""  # "Wor" may still become "World!"
    assert det.feed("m").delta == "Worm"
    assert det.feed(" Wor").delta == " "
    assert det.finish() == "Wor"  # generation ended for another reason: show the rest
    assert not det.stopped and det.text == "Hello Worm Wor"


def test_the_first_completed_stop_wins():
    # "bc" is complete before "abcd" is, so a stream would have stopped there
    assert check_stop("", "abcd", ["abcd", "bc"]).text == "a"
    # two stops completed by the same character: the earlier start (longer) one is cut
    result = check_stop("x", "abc", ["bc", "abc"])
    assert (result.text, result.stop) == ("x", "abc")


def test_text_after_the_stop_in_the_same_piece_is_dropped():
    result = check_stop("one ", "two\n\nthree", ["\n\n"])
    assert result.stopped and result.text == "one two" and result.stable == len("one two")


def test_only_windows_reaching_into_the_new_piece_are_searched():
    assert find_stop("ab|cd", ["ab"], new_chars=3) is None
    assert find_stop("ab|cd", ["b|c"], new_chars=3).start == 1
    assert find_stop("ab|cd", ["ab"]).start == 0


def test_partial_stop_len():
    assert partial_stop_len("hello wor", ["world", "or not"]) == 3
    assert partial_stop_len("abc", ["abc"]) == 0  # a whole stop is a match, not a partial
    assert partial_stop_len("ab", ["zzz"]) == 0
    assert partial_stop_len("", ["a"]) == 0
    assert partial_stop_len("aaa", ["aaaa"]) == 3


def test_feeding_after_a_stop_is_an_error():
    det = StopStringDetector(["x"])
    assert det.feed("ax").stopped
    with pytest.raises(ValueError, match="already ended"):
        det.feed("b")


def reference(text, stops, include):
    """Brute force: the first end position at which any stop string is complete."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[: end - len(stop)]), True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=12),
    include=st.booleans(),
)
def test_streaming_matches_whole_text_reference_and_never_retracts(text, stops, cuts, include):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] + [""]
    det = StopStringDetector(stops, include)
    shown = ""
    for piece in pieces:
        update = det.feed(piece)
        shown += update.delta
        assert det.text.startswith(shown)  # what was shown is never taken back
        if update.stopped:
            break
    if not det.stopped:
        shown += det.finish()
    expected_text, expected_stopped = reference(text, stops, include)
    assert (det.text, det.stopped) == (expected_text, expected_stopped)
    assert shown == expected_text
