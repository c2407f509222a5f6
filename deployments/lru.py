"""A bounded map that forgets its oldest entries: the ingress's and the router's per-request bookkeeping."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, ValuesView
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
_MISSING = object()


class BoundedLRU(Generic[K, V]):
    """At most `capacity` entries; `put` makes an entry the newest and drops the oldest past the bound.

    A plain class, not an OrderedDict subclass: Serve pickles the ingress app, and an OrderedDict subclass is rebuilt
    by calling its class with no argument."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._entries.get(key, default)

    def pop(self, key: K, default=_MISSING):
        return self._entries.pop(key) if default is _MISSING else self._entries.pop(key, default)

    def items(self) -> ItemsView[K, V]:
        return self._entries.items()

    def values(self) -> ValuesView[V]:
        return self._entries.values()

    def __len__(self) -> int:
        return len(self._entries)
