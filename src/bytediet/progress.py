"""Progress display on stderr (stdout stays clean for ``--json``): one place for every bar.

A *progress function* ``progress(items, desc) → iterator`` wraps a loop: :func:`no_progress` iterates
silently, :func:`rich_progress` shows one transient bar (calibration, evaluation). :class:`Bars` keeps
one bar per step of a longer run (``bytediet optimize``). :func:`rich_meter` is a bar with figures (training).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

Progress = Callable[[Sequence, str], Iterator]


def no_progress(items: Sequence, desc: str) -> Iterator:
    """Iterate silently."""
    return iter(items)


def rich_progress(items: Sequence, desc: str) -> Iterator:
    """Iterate with a transient rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with RichProgress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield from bar.track(items, description=desc, total=len(items))


class Bars:
    """Rich progress bars on stderr (one line per step), or nothing when ``enabled`` is False."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> "Bars":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
                TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)

    def track(self, items: list, title: str):
        if not self.enabled:
            yield from items
            return
        task = self.bar.add_task(title, total=len(items))
        for item in items:
            label = getattr(item, "label", str(item))
            self.bar.update(task, description=f"{title}: {label}")
            yield item
            self.bar.advance(task)
        self.bar.update(task, description=title)

    def spin(self, title: str):
        return _Spin(self, title)


class _Spin:
    def __init__(self, bars: Bars, title: str) -> None:
        self.bars, self.title = bars, title

    def __enter__(self):
        if self.bars.enabled:
            self.task = self.bars.bar.add_task(self.title, total=1)

    def __exit__(self, *exc) -> None:
        if self.bars.enabled and exc[0] is None:
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
        TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with RichProgress(*columns, console=Console(stderr=True)) as bar:
        yield _RichMeter(bar, bar.add_task(desc, total=total, completed=completed), desc)


@contextmanager
def no_meter(total: int, desc: str, completed: int = 0) -> Iterator[Meter]:
    """No display."""
    yield Meter()
