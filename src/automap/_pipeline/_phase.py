"""The phases of a pipelined training step: one name for each, read by every part.

The partition gives each op a phase (`_split.split_backward` moves a stage's weight-
gradient ops from BWD to WGT for schedules that run them apart), the schedule orders the per-microbatch phases' work,
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
    # Once per microbatch on schedules that split the backward (ZB-H1): the backward ops
    # that make only weight gradients (`_split.split_backward`), run as a program of
    # their own after BWD, which then computes only what the stage sends upstream and
    # what these read. No op has it unless a schedule splits the backward.
    WGT = 5

    def __str__(self) -> str:
        return self.name.lower()

    @property
    def per_microbatch(self) -> bool:
        """Runs once per microbatch (the schedule's units), not once per step."""
        return self in (Phase.FWD, Phase.BWD, Phase.WGT)

    @property
    def backward(self) -> bool:
        """Part of a microbatch's backward: the whole of it (BWD), or its weight-gradient
        share where a schedule splits it (WGT)."""
        return self in (Phase.BWD, Phase.WGT)
