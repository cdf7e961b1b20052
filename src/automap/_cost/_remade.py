"""A recomputed layer's stored values in a pipeline stage's backward walk
(`_traffic.temporaries`): each alive from the layer's recompute to the last backward read
of the residuals it is stored for, as XLA frees it."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._graph import Graph
from .._pipeline import Partition, Phase

if TYPE_CHECKING:
    from ._buffers import Held

# A plain int: a numpy int compared with an IntEnum member probes its class (slow).
_BWD = int(Phase.BWD)


class Remade(NamedTuple):
    """Recomputed residuals in the backward walk (`_traffic.temporaries`): those of one
    layer whose backward last reads what they serve at the same op."""

    stage: int
    first: int  # the backward op that first reads the layer's residuals: the recompute
    last: int  # the backward op that last reads what these serve
    nbytes: float  # per device, one microbatch's


def recomputed_values(
    graph: Graph,
    part: Partition,
    inv: np.ndarray,
    res,
    layer_stored: Sequence[tuple[Held, ...]],
    m: int,
    phase: np.ndarray,
    late: Collection[int] = (),
) -> list[Remade]:
    """Per recomputed layer, the residuals it makes again in its backward: one
    microbatch's, each alive from the first backward op that reads the layer's residuals
    (the recompute runs just before it) to the last backward read of the residuals it is
    stored for, where XLA frees it (an op in `late` reads at its stage's last op). The
    layer and its backward are one program (the stage's B), so these are the ones XLA
    stores (`stored_residuals`), of what the recompute makes: an operand it stores in
    place of a cheap residual and that comes from outside the layer (its input, a weight)
    is held already. `layer_stored`: `stored_residuals` of each of `res.layer_saved`,
    each with the width the one-stage step holds it at (`_buffers.held_widths`: a float32
    residual only matmuls read, as their bf16 operand on a TPU)."""
    consumers, stage = graph.consumers(), part.op_stage
    again = set(res.recomputed)
    ends = _program_ends(part, phase, late)

    def reads(t: int) -> list[int]:
        return [ends.get(c, c) for c in consumers[t] if phase[c] == _BWD]

    out: dict[tuple[int, int, int], float] = {}
    for ts, stored in zip(res.layer_saved, layer_stored, strict=True):
        first = [c for t in ts for c in reads(t)]
        if not first:
            continue
        s = stage[graph.tensors[ts[0]].producer]
        for t, w, serves in stored:
            p = graph.tensors[t].producer
            last = [c for r in (t, *serves) for c in reads(r)]
            if p not in again or stage[p] != s or not last:
                continue
            key = (s, min(first), max(last))
            b = graph.tensors[t].nbytes * w * inv[t] / (m if t in part.batched else 1)
            out[key] = out.get(key, 0.0) + b
    return [Remade(s, first, last, b) for (s, first, last), b in out.items()]


def _program_ends(part: Partition, phase: np.ndarray, late: Collection[int]) -> dict[int, int]:
    """{op of `late` in a stage's B: the last op of that B}, where it runs."""
    if not late:
        return {}
    stage = np.asarray(part.op_stage)
    ops = np.flatnonzero(phase == _BWD)
    end = dict(zip(stage[ops].tolist(), ops.tolist(), strict=True))  # the last op wins
    return {i: end[int(stage[i])] for i in late if phase[i] == _BWD}
