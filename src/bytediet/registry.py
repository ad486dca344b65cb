"""One tiny registry per extension point (weight formats, KV codecs, hardware, eval tasks, calibration methods).

A new implementation is one new file with ``@REGISTRY.register("name")`` on it plus one import line in its
package's ``__init__``, which registers every built-in implementation when the package is imported.
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

    def build(self, spec: str):
        """Build an implementation from a spec string: the one parser for weight formats and KV codecs.

        An exact name calls the registered class with no arguments (``"int8"``); otherwise the longest
        registered name that starts the spec and has a ``from_spec`` classmethod gets the rest
        (``"int4-g128"`` → ``Int4.from_spec("-g128")``, ``"turboquant3.5"`` → ``from_spec("3.5")``).
        An unknown spec raises the standard ``KeyError`` that lists the registered names.
        """
        spec = spec.strip().lower()
        if spec in self._items:
            return self._items[spec]()
        for name in sorted(self._items, key=len, reverse=True):
            item = self._items[name]
            if spec.startswith(name) and hasattr(item, "from_spec"):
                return item.from_spec(spec[len(name) :])
        self.get(spec)  # raises the "unknown ... choose one of" KeyError
        raise AssertionError("unreachable")
