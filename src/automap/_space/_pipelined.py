"""The pipelined plan space: the outer level's points (stage count, stage mesh,
microbatches, where the intra-stage plan comes from), and which values each may take.

The dp searcher enumerates it, the expert pipelines and the DQN's staged decision
processes pick points of it; all of them read the space's shape from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._graph import Graph, Role
from .._groups import Groups


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


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """The bytes of the state a training step keeps between steps, every leaf it reads:
    its parameters and its optimizer state."""

    params: float
    opt_state: float

    def floor(self, stages: int, model: int, data: int = 1, zero: int = 0) -> float:
        """Bytes per device the busiest stage holds at least: the parameters, their
        gradients (at least half their bytes: 16-bit sums of float32 parameters) and the
        optimizer state, each split at most `model` ways, and over `data` too where ZeRO
        may split it (stage 1 and up the gradients and optimizer state, stage 3 the
        parameters as well), over the stages (the busiest holds at least their mean).
        Below what the cost model prices any plan of that shape, so a shape above the
        memory limit need not be priced."""
        shard = data if zero else 1
        whole = self.params if zero < 3 else self.params / data
        return (whole + (self.params / 2 + self.opt_state) / shard) / (stages * model)


def state_bytes(graph: Graph, groups: Groups) -> StateBytes | None:
    """The step's `StateBytes`; None where such a leaf shares a linkage group with the
    batch: a plan could split it over the data axis without ZeRO, no floor."""
    batch = set(groups.batch_groups)
    consumers = graph.consumers()
    params = [x for x in graph.leaves(Role.PARAM) if consumers[x.tensor]]
    state = [x for x in graph.leaves(Role.OPT_STATE) if consumers[x.tensor]]
    if any(batch & set(groups.tensor_groups[x.tensor]) for x in params + state):
        return None
    return StateBytes(
        params=float(sum(graph.tensors[x.tensor].nbytes for x in params)),
        opt_state=float(sum(graph.tensors[x.tensor].nbytes for x in state)),
    )
