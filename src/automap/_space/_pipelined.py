"""The pipelined plan space: the outer level's points (stage count, stage mesh,
microbatches, where the intra-stage plan comes from), and which values each may take.

The dp searcher enumerates it, the expert pipelines and the DQN's staged decision
processes pick points of it; all of them read the space's shape from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Point:
    """One point of the outer level."""

    stages: int
    stage_mesh: Mapping[str, int]
    microbatches: int
    intra: str  # where the intra-stage assignment comes from: "ilp" or "megatron_dp"


def stage_counts(devices: int, candidates: int, per_node: int) -> list[int]:
    """S >= 2 dividing the devices, with enough cut candidates for S - 1 cuts, whose stages
    fill whole nodes or divide one where the devices span several: 280 GPUs in 2 stages of
    140 would split a node of 8 between two stages (and a stage of 140 is no cluster)."""
    return [
        s
        for s in range(2, devices + 1)
        if devices % s == 0
        and s - 1 <= candidates
        and _node_aligned(devices // s, devices, per_node)
    ]


def _node_aligned(per_stage: int, devices: int, per_node: int) -> bool:
    return devices <= per_node or per_stage % per_node == 0 or per_node % per_stage == 0


def microbatch_counts(batch: int, data: int, stages: int, allowed: bool) -> list[int]:
    """Powers of two m with batch / m divisible by the data axis; m >= S when possible
    (fewer microbatches than stages leaves a stage idle all along)."""
    if not allowed:
        return [1]
    counts = [m for m in (2**k for k in range(12)) if batch % (m * data) == 0]
    return [m for m in counts if m >= stages] or counts[-1:]
