"""Progress display on stderr (stdout stays clean for ``--json``): one place for every bar.

A *progress function* ``progress(items, desc) → iterator`` wraps a loop: :func:`no_progress` iterates
silently, :func:`rich_progress` shows one transient bar (calibration, evaluation). :class:`Bars` keeps
one bar per step of a longer run (``bytediet optimize``). :func:`rich_meter` is a bar with figures (training).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

Progress = Callable[[Sequence, str], Iterator]


def no_progress(items: Sequence, desc: str) -> Iterator:
    """Iterate silently."""
    return iter(items)


def rich_progress(items: Sequence, desc: str) -> Iterator:
    """Iterate with a transient rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with RichProgress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield from bar.track(items, description=desc, total=len(items))


class Bars:
    """Progress of a longer run on stderr: rich bars (one line per step) on a terminal, plain lines elsewhere
    (a log file, CI), nothing when ``enabled`` is False. ``plain`` None: decided by whether stderr is a terminal."""

    def __init__(self, enabled: bool, plain: Optional[bool] = None) -> None:
        self.enabled = enabled
        self.plain = (not sys.stderr.isatty()) if plain is None else plain

    def __enter__(self) -> "Bars":
        if self.enabled and not self.plain:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.plain:
            self.bar.__exit__(*exc)

    def line(self, text: str) -> None:
        """One line of plain text on stderr (above the bars on a terminal)."""
        if not self.enabled:
            return
        if self.plain:
            print(text, file=sys.stderr, flush=True)
        else:
            self.bar.console.print(text, highlight=False)

    def track(self, items: list, title: str, eta: Optional[Callable[[int], Optional[float]]] = None):
        """Yield ``items`` showing ``title``, the item's label, and ``eta(i)`` (seconds left, or None) if given."""
        if not self.enabled:
            yield from items
            return
        task = None if self.plain else self.bar.add_task(title, total=len(items))
        for i, item in enumerate(items):
            label = item.get("label", str(item)) if isinstance(item, dict) else getattr(item, "label", str(item))
            left = eta(i) if eta is not None else None
            text = f"{title}: {label}" + (f" (about {_duration(left)} left)" if left else "")
            if self.plain:
                print(f"{text} [{i + 1}/{len(items)}]", file=sys.stderr, flush=True)
            else:
                self.bar.update(task, description=text)
            yield item
            if task is not None:
                self.bar.advance(task)
        if task is not None:
            self.bar.update(task, description=title)

    def spin(self, title: str):
        return _Spin(self, title)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class _Spin:
    def __init__(self, bars: Bars, title: str) -> None:
        self.bars, self.title = bars, title

    def __enter__(self):
        if self.bars.enabled and self.bars.plain:
            self.t0 = time.perf_counter()
            print(f"{self.title} ...", file=sys.stderr, flush=True)
        elif self.bars.enabled:
            self.task = self.bars.bar.add_task(self.title, total=1)

    def __exit__(self, *exc) -> None:
        if self.bars.enabled and self.bars.plain and exc[0] is None:
            print(f"{self.title}: done in {_duration(time.perf_counter() - self.t0)}", file=sys.stderr, flush=True)
        elif self.bars.enabled and exc[0] is None:
            self.bars.bar.update(self.task, completed=1)


class Meter:
    """A counted loop whose bar also shows a line of figures (training: loss, tokens seen)."""

    def advance(self, info: str = "") -> None:
        """One more step done; ``info`` replaces the figures shown after the description."""


class _RichMeter(Meter):
    def __init__(self, bar, task, desc: str) -> None:
        self.bar, self.task, self.desc = bar, task, desc

    def advance(self, info: str = "") -> None:
        self.bar.update(self.task, advance=1, description=f"{self.desc} {info}".rstrip())


@contextmanager
def rich_meter(total: int, desc: str, completed: int = 0) -> Iterator[Meter]:
    """A rich bar on stderr from ``completed`` to ``total`` whose text :meth:`Meter.advance` updates."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgress

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with RichProgress(*columns, console=Console(stderr=True)) as bar:
        yield _RichMeter(bar, bar.add_task(desc, total=total, completed=completed), desc)


@contextmanager
def no_meter(total: int, desc: str, completed: int = 0) -> Iterator[Meter]:
    """No display."""
    yield Meter()
