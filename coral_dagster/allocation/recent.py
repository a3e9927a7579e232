"""A small memo of the last few results, keyed by the identity of a large input (a template tuple)."""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class Recent(Generic[T]):
    """Results for the last `size` inputs, matched by identity (`is`) and an optional equal `key`.

    Identity is cheap on a tuple of hundreds of thousands of templates, and safe: the memo holds the input, so
    its id cannot be reused while it is remembered. The most recently used entry is kept longest.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[tuple[object, Hashable, T]] = []

    def get(self, held: object, make: Callable[[], T], key: Hashable = None) -> T:
        for pos, (obj, k, value) in enumerate(self.items):
            if obj is held and k == key:
                self.items.append(self.items.pop(pos))
                return value
        value = make()
        self.items.append((held, key, value))
        del self.items[:-self.size]
        return value
