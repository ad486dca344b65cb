"""Stop strings over incrementally growing output text, safe for streaming.

A stop string may span token boundaries, so each check looks at the new piece together with
the end of the text before it. The rule that decides which stop matches is "the first one to
be completed": the occurrence with the earliest *end* (then the earliest start). That rule
makes the result independent of how the text was cut into pieces, which is what streaming
needs. Until a stop string is ruled out, the tail of the text that could be its beginning is
held back, so a stream never shows text that a later stop would retract.

The caller feeds text that will not change any more: an incremental detokenizer must hold
back an incomplete UTF-8 sequence itself (it decodes to U+FFFD until the next token arrives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StopMatch:
    """An occurrence of ``stop`` at ``text[start:end]``."""

    stop: str
    start: int
    end: int


@dataclass(frozen=True)
class StopCheck:
    """Outcome of one check: the output ``text`` (cut at the stop string when one matched),
    whether to stop, which string matched, and ``stable``: ``text[:stable]`` can be shown now
    and will never be retracted."""

    text: str
    stopped: bool
    stop: Optional[str]
    stable: int


def find_stop(text: str, stops: Sequence[str], new_chars: Optional[int] = None) -> Optional[StopMatch]:
    """The earliest-ending occurrence of any of ``stops`` that ends within the last ``new_chars``
    characters of ``text`` (all of it when None), or None.

    Earlier text is assumed already checked, so only windows that reach into the new part are
    searched: O(len(new part) + longest stop) per stop string.
    """
    old_len = 0 if new_chars is None else len(text) - new_chars
    best: Optional[StopMatch] = None
    for stop in stops:
        start = text.find(stop, max(0, old_len - len(stop) + 1))
        if start < 0:
            continue
        match = StopMatch(stop, start, start + len(stop))
        if best is None or (match.end, match.start) < (best.end, best.start):
            best = match
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string
    (the part that must be held back: it may still grow into a stop)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def check_stop(text: str, piece: str, stops: Sequence[str], include_stop_str_in_output: bool = False) -> StopCheck:
    """Append ``piece`` to ``text`` (already checked, with no stop in it) and look for a stop.

    On a match the text is cut just before the stop string, or just after it with
    ``include_stop_str_in_output``; anything after it in ``piece`` is dropped. Without a match,
    the possible beginning of a stop string at the end is held back (nothing is held back
    with ``include_stop_str_in_output``: then every character before a stop's end is output
    anyway).
    """
    full = text + piece
    match = find_stop(full, stops, len(piece))
    if match is not None:
        cut = full[: match.end if include_stop_str_in_output else match.start]
        return StopCheck(cut, True, match.stop, len(cut))
    hold = 0 if include_stop_str_in_output else partial_stop_len(full, stops)
    return StopCheck(full, False, None, len(full) - hold)


@dataclass(frozen=True)
class StopUpdate:
    """What one new piece of text produced: ``delta`` to show now, and whether to stop."""

    delta: str
    stopped: bool
    stop: Optional[str] = None


class StopStringDetector:
    """Per-request streaming state: the output text and how much of it was already shown."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(stops)
        self.include = include_stop_str_in_output
        self.text = ""
        self.shown = 0
        self.stop: Optional[str] = None

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def feed(self, piece: str) -> StopUpdate:
        """Add newly detokenized text; returns the text that is safe to show now."""
        if self.stopped:
            raise ValueError(f"the stop string {self.stop!r} already ended this output")
        result = check_stop(self.text, piece, self.stops, self.include)
        self.text, self.stop = result.text, result.stop
        delta = self.text[self.shown : result.stable]
        self.shown = max(self.shown, result.stable)
        return StopUpdate(delta, result.stopped, result.stop)

    def finish(self) -> str:
        """Generation ended for another reason (length, EOS, stop token): release the held-back tail."""
        delta = self.text[self.shown :]
        self.shown = len(self.text)
        return delta
