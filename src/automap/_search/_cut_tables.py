"""The stage DP's tables for one point, and its cuts: per segment of the finest partition
(every cut candidate a boundary), the time of each per-microbatch phase, the state and
activation bytes, and the send after it; summed over (stage, first, last segment) for
`_solvers.optimal_partition`.

Phases are timed apart because schedules run them apart: 1F1B a forward and a whole
backward, ZB-H1 (`_pipeline/_zero_bubble.py`) a forward, B and W, the W's deferred into
the drain. The backward is split as the runtime and the cost model split it
(`split_backward` on the finest partition), with one difference the segments cannot see:
the first stage sends nothing upstream, so its whole backward is W whatever segments it
holds (`_split.py`), and its table says so. The DP's objective weighs the sum of the
stage times by the schedule's bubble (`fill_weight`) and, where the backward is split,
times its best few partitions by the schedule's own simulation of these per-phase times
(`PipelineSchedule.simulate`, sends as lags): ZB-H1's step on unequal stages depends on
how each stage's time divides into F, B and W (the first stage's is all F and W), which
no closed form in the stage totals holds.

What the tables leave out, the whole pipeline model (`estimate_pipeline`) prices when the
searcher prices the cuts: what runs once per step, and what a deferred W holds beyond
1F1B's in-flight microbatches (`_cost/_deferred.py`), which can make a ZB-H1 partition the
DP sized to the limit not fit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._cost import pipe_link, sends, stage_costs
from .._pipeline import Partition, Phase, PipelineSchedule, split_backward
from .._solvers import optimal_partition
from .._space import Point


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentTables:
    """Per segment of the finest partition, for one intra-stage plan, m and schedule."""

    phases: tuple[Phase, ...]  # the schedule's per-microbatch phases, the columns below
    phase_s: np.ndarray  # [L, P] seconds per microbatch of each phase (recompute in BWD)
    state: np.ndarray  # [L] parameter, gradient and optimizer bytes per device
    act: np.ndarray  # [L] activation bytes per device per microbatch held for backward
    send: np.ndarray  # [L] lag of a microbatch crossing the boundary after it (0 after last)

    @property
    def time(self) -> np.ndarray:
        """[L] seconds per microbatch, every phase."""
        return self.phase_s.sum(axis=1)

    @staticmethod
    def span(x: np.ndarray, first: int, last: int) -> float:
        """The sum of a per-segment column over segments first..last."""
        return float(x[first : last + 1].sum())

    def stage_phase_s(self, n_stages: int) -> np.ndarray:
        """[S, L, L, P] seconds per microbatch of each phase of stage s holding segments
        i..j (inf where j < i; the first stage's backward all W where the schedule splits
        it)."""
        prefix = np.concatenate([np.zeros((1, len(self.phases))), np.cumsum(self.phase_s, 0)])
        ranges = prefix[None, 1:] - prefix[:-1, None]  # [L, L, P]: sum over i..j
        out = np.repeat(ranges[None], n_stages, axis=0)
        if Phase.WGT in self.phases:
            b, w = self.phases.index(Phase.BWD), self.phases.index(Phase.WGT)
            out[0, ..., w] += out[0, ..., b]
            out[0, ..., b] = 0.0
        L = len(self.phase_s)
        out[:, ~np.triu(np.ones((L, L), dtype=bool))] = np.inf
        return out

    def stage_time(self, n_stages: int) -> np.ndarray:
        """[S, L, L] seconds per microbatch of stage s holding segments i..j, every phase
        plus its send (all but the last stage): the DP's tau."""
        time = self.stage_phase_s(n_stages).sum(axis=-1)
        last = np.arange(n_stages) == n_stages - 1
        return time + np.where(last[:, None, None], 0.0, self.send[None, None, :])

    def stage_memory(self, n_stages: int, in_flight) -> np.ndarray:
        """[S, L, L] bytes per device of stage s holding segments i..j, `in_flight[s]`
        microbatches of activations."""
        copies = np.asarray(in_flight, dtype=float)
        return _range_sums(self.state)[None] + copies[:, None, None] * _range_sums(self.act)[None]


def _range_sums(x: np.ndarray) -> np.ndarray:
    """[L, L]: the sum of x[i..j]."""
    prefix = np.concatenate([[0.0], np.cumsum(x)])
    return prefix[None, 1:] - prefix[:-1, None]


def segment_tables(
    model, fine: Partition, oc, microbatches: int, schedule: PipelineSchedule, stages: int
) -> SegmentTables:
    """The tables of `fine` with `oc`'s intra-stage plan, priced by the pipeline cost
    model as `schedule` runs it (its backward split where the schedule splits it), for
    `stages` stages: the sends cross the link between consecutive ones of S stages, not
    of the finest partition's (as many as candidates: across nodes where S stages are not)."""
    pc = stage_costs(model, fine, oc, microbatches, schedule)
    split = split_backward(model.graph, fine) if schedule.splits_backward else fine
    cluster = model.cluster
    link = pipe_link(cluster, oc.mesh, stages)
    traffic = sends(model.graph, split, oc.layouts, link, cluster.comm_efficiency, microbatches)
    send = [max(f, b) for f, b in zip(traffic.fwd_s, traffic.bwd_s, strict=True)]
    seg = np.asarray(split.op_stage)
    op_phase = np.asarray([int(p) for p in split.op_phase])
    L, phases = fine.n_stages, schedule.phases
    phase_s = np.zeros((L, len(phases)))
    for k, p in enumerate(phases):
        own = np.where(op_phase == p, pc.op_run_s, 0.0)
        if p is Phase.BWD:  # a recomputed forward runs again in the backward
            own = own + pc.op_remat_s
        phase_s[:, k] = np.bincount(seg, own, minlength=L)
    return SegmentTables(
        phases=phases,
        phase_s=phase_s,
        state=np.bincount(seg, pc.op_state_bytes, minlength=L),
        act=np.bincount(seg, pc.op_act_bytes, minlength=L),
        send=np.append(np.asarray(send, dtype=float), 0.0),
    )


def fill_weight(schedule: PipelineSchedule, stages: int, microbatches: int) -> float:
    """kappa of the DP's objective (M - 1) max tau + kappa sum tau: (1 + idle) / S, so
    that equal stages cost (M + idle) tau, `idle` the schedule's idle slots (1 for GPipe
    and 1F1B, whose idle is S - 1; (S + 2) / 3S for ZB-H1's (S - 1) / 3 when M >= S)."""
    return (1.0 + schedule.idle_slots(stages, microbatches)) / stages


def optimal_cuts(
    model, fine: Partition, cands, oc, point: Point, schedule: PipelineSchedule
) -> tuple[int, ...] | None:
    """The stage DP's cuts (ops where stages 1.. start) for one point, None where no
    partition fits: `fine`'s segment tables summed into (stage, first segment, last
    segment) tables, the DP's objective read from `schedule` (module doc)."""
    m, S = point.microbatches, point.stages
    tables = segment_tables(model, fine, oc, m, schedule, S)
    rescore = None
    if schedule.splits_backward:
        per_phase = tables.stage_phase_s(S)

        def rescore(stages) -> float:
            times = [tuple(per_phase[s, i, j - 1]) for s, (i, j) in enumerate(stages)]
            sends = [float(tables.send[j - 1]) for _, j in stages[:-1]]
            units = schedule.simulate(S, m, times, sends)
            return max(u.end for u in units)

    sol = optimal_partition(
        tables.stage_time(S),
        m,
        stage_memory=tables.stage_memory(S, schedule.in_flight(S, m)),
        memory_limit=model.cluster.memory_limit,
        fill_weight=fill_weight(schedule, S, m),
        rescore=rescore,
    )
    if not sol.feasible:
        return None
    return tuple(cands[i - 1] for i, _ in sol.stages[1:])
