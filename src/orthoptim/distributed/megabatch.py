"""Megabatching: every matrix of one (shape, dtype, device, options) is processed as one batch."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")


def megabatches(items: Iterable[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """Group ``items`` by ``key``, keeping first-seen order of keys and items (deterministic on
    every rank, so distributed ranks agree on the batches without communicating)."""
    batches: dict[Hashable, list[T]] = {}
    for item in items:
        batches.setdefault(key(item), []).append(item)
    return list(batches.values())
