"""The phases of a pipelined training step: one name for each, read by every part.

The partition gives each op a phase, the schedule orders the per-microbatch phases' work,
the cost model indexes its per-phase arrays by it, the runtime labels its programs with
it, and the report colours its units by it. An `IntEnum` so that the cost model's numpy
arrays of phases compare and index with the members directly (`phase == Phase.FWD`,
`busy[:, Phase.BWD]`); `str()` gives the lower-case name ("fwd"), as messages print it.
"""

from __future__ import annotations

import enum


class Phase(enum.IntEnum):
    PRE = 0  # once per step, before the microbatches (reads only inputs)
    FWD = 1  # once per microbatch, forward
    BWD = 2  # once per microbatch, backward
    POST = 3  # once per step, after the microbatches (reads accumulated sums)
    # Once per step on each stage after its last backward: the reduction of its
    # accumulated tensors' partial sums (the runtime's reduce program). No op is partitioned
    # into it; the cost model moves the batch-axis reductions of accumulated tensors here.
    REDUCE = 4

    def __str__(self) -> str:
        return self.name.lower()

    @property
    def per_microbatch(self) -> bool:
        """Runs once per microbatch (the schedule's units), not once per step."""
        return self in (Phase.FWD, Phase.BWD)
