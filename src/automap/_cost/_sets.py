"""The sets the tables index: a *set* is a sorted tuple of splittable group ids, the groups
of one tensor's dims or of an op's iteration space.

Every per-plan quantity is a function of which mesh axes a set holds, so the tables index
sets rather than tensors (`_tables.py`). Ids are given in the order sets are first met,
so one graph always gets the same ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np


@dataclasses.dataclass(frozen=True)
class SetIndex:
    """The ids of the sets met so far; `of` gives a new set the next id."""

    split: np.ndarray  # [n_groups + 1] whether each group is splittable (the pad never is)
    ids: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)

    def of(self, groups: Iterable[int]) -> int:
        """The id of the set of `groups`' splittable ones (unsplittable groups never hold
        an axis, so they tell no sets apart)."""
        key = tuple(sorted({g for g in groups if self.split[g]}))
        return self.ids.setdefault(key, len(self.ids))

    def table(self, pad_group: int) -> np.ndarray:
        """[n_sets, K] each set's group ids, padded with `pad_group` (never split)."""
        width = max(1, *(len(k) for k in self.ids))
        sets = np.full((len(self.ids), width), pad_group, dtype=np.int64)
        for key, i in self.ids.items():
            sets[i, : len(key)] = key
        return sets
