"""One tiny registry per extension point (weight formats, KV codecs, hardware, eval tasks).

A new implementation is one new file with ``@REGISTRY.register("name")`` on it; nothing else is edited.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a lower-case name to an implementation (a class or a factory)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        key = name.lower()

        def decorator(item: T) -> T:
            if key in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[key] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        key = name.lower()
        if key not in self._items:
            raise KeyError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._items)) or '(none registered)'}"
            )
        return self._items[key]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
