"""The stage DP's tables for one point, and its cuts: per segment of the finest partition
(every cut candidate a boundary), the time of each per-microbatch phase, the state and
activation bytes, and the bytes and messages a microbatch sends across the boundary after
it; summed over (stage, first, last segment) for `_solvers.optimal_partition`.

A send is timed once the DP knows the stage it closes: stage s's on cut s's link
(`_cost/_sends.py`: NVLink between two device groups on one node, the network between
nodes), so on a pipe axis spanning nodes only the cuts that cross one pay the network.

Phases are timed apart because schedules run them apart: 1F1B a forward and a whole
backward, ZB-H1 (`_pipeline/_zero_bubble.py`) a forward, B and W, the W's deferred into
the drain. The backward is split as the runtime and the cost model split it
(`split_backward` on the finest partition), with one difference the segments cannot see:
a stage that sends nothing upstream runs its whole backward as W whatever segments it
holds (`_split.py`): the first, and one whose first segment's boundary no backward value
crosses (after an embedding whose gradient the next layer's stage makes, say). Its
table says so (`sends_back`). The DP's objective weighs the sum of the
stage times by the schedule's bubble (`fill_weight`) and, where the backward is split,
times its best few partitions by the schedule's own simulation of these per-phase times
(`PipelineSchedule.simulate`, sends as lags): ZB-H1's step on unequal stages depends on
how each stage's time divides into F, B and W (the first stage's is all F and W), which
no closed form in the stage totals holds.

Memory: each stage's state and its in-flight microbatches' activations, and where the
backward is split, what its deferred W's hold beyond those (`_cost/_deferred.py`: the
same values, `deferred_holds`, and the same fullest moment, `deferred_beyond`, read off
the schedule's `live_counts`). A value is held on a stage that runs one of its readers
(and its maker, for a B's value W reads): counted once per stage, which over the finest
partition's segments is a sum over pairs of segments (`_pair_ranges`), so every layer
range gets it exactly as the whole model counts it on that stage (a stage that sends
nothing upstream holding all its residuals for W).

What the tables leave out, the whole pipeline model (`estimate_pipeline`) prices when the
searcher prices the cuts: what runs once per step, and a stage's temporaries.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._cost import PipeLinks, deferred_beyond, deferred_holds, stage_costs
from .._pipeline import Partition, Phase, PipelineSchedule, split_backward
from .._solvers import optimal_partition
from .._space import Point


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentTables:
    """Per segment of the finest partition, for one intra-stage plan, m and schedule."""

    schedule: PipelineSchedule
    microbatches: int
    phases: tuple[Phase, ...]  # the schedule's per-microbatch phases, the columns below
    phase_s: np.ndarray  # [L, P] seconds per microbatch of each phase (recompute in BWD)
    state: np.ndarray  # [L] parameter, gradient and optimizer bytes per device
    act: np.ndarray  # [L] activation bytes per device per microbatch held for backward
    # [L] per microbatch across the boundary after segment i (0 after the last), each
    # direction: bytes per device and messages, timed on a cut's link by `send_after`.
    fwd_bytes: np.ndarray
    fwd_count: np.ndarray
    bwd_bytes: np.ndarray
    bwd_count: np.ndarray
    links: PipeLinks  # where the S stages' device groups sit
    stages: int  # S, the stages the tables were made for
    # [L] the backward sends a value across the boundary before segment i (never before
    # the first): a stage starting at a segment where it does not runs no B, all W.
    sends_back: np.ndarray
    # Where the backward is split: [L, L] bytes per device per microbatch a stage holding
    # segments i..j keeps of all its residuals, and of W's share (`deferred_holds`).
    held: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def time(self) -> np.ndarray:
        """[L] seconds per microbatch, every phase."""
        return self.phase_s.sum(axis=1)

    def send_after(self, stage: int) -> np.ndarray:
        """[L] lag of a microbatch crossing the boundary after segment i where that
        boundary is the cut after `stage` (stage -> stage + 1), on that cut's link: the
        larger direction, alpha-beta per message as `sends` times it. A send from a
        segment further up is timed on this cut's link too: which stage made it is not
        known here (`stage_costs` times it on the link between the two stages)."""
        fwd = self.links.lag(stage, self.fwd_bytes, self.fwd_count)
        bwd = self.links.lag(stage, self.bwd_bytes, self.bwd_count)
        return np.maximum(fwd, bwd)

    @staticmethod
    def span(x: np.ndarray, first: int, last: int) -> float:
        """The sum of a per-segment column over segments first..last."""
        return float(x[first : last + 1].sum())

    def stage_phase_s(self, n_stages: int) -> np.ndarray:
        """[S, L, L, P] seconds per microbatch of each phase of stage s holding segments
        i..j (inf where j < i; where the schedule splits the backward, all W on a stage
        that sends nothing upstream: the first, or one starting after no `sends_back`)."""
        prefix = np.concatenate([np.zeros((1, len(self.phases))), np.cumsum(self.phase_s, 0)])
        ranges = prefix[None, 1:] - prefix[:-1, None]  # [L, L, P]: sum over i..j
        out = np.repeat(ranges[None], n_stages, axis=0)
        if Phase.WGT in self.phases:
            b, w = self.phases.index(Phase.BWD), self.phases.index(Phase.WGT)
            alone = self._alone(n_stages)
            out[alone, :, w] += out[alone, :, b]
            out[alone, :, b] = 0.0
        L = len(self.phase_s)
        out[:, ~np.triu(np.ones((L, L), dtype=bool))] = np.inf
        return out

    def _alone(self, n_stages: int) -> np.ndarray:
        """[S, L] stage s starting at segment i sends nothing upstream."""
        alone = np.repeat(~self.sends_back[None], n_stages, axis=0)
        alone[0] = True
        return alone

    def stage_time(self, n_stages: int) -> np.ndarray:
        """[S, L, L] seconds per microbatch of stage s holding segments i..j, every phase
        plus its send on its own cut's link (all but the last stage): the DP's tau."""
        if n_stages != self.stages:
            raise ValueError(f"these tables time sends for {self.stages} stages, not {n_stages}")
        time = self.stage_phase_s(n_stages).sum(axis=-1)
        send = [self.send_after(s) for s in range(n_stages - 1)]
        send.append(np.zeros(len(self.phase_s)))  # the last stage sends nothing on
        return time + np.stack(send)[:, None, :]

    def stage_memory(self, n_stages: int) -> np.ndarray:
        """[S, L, L] bytes per device of stage s holding segments i..j: its state, the
        schedule's in-flight microbatches of activations, and what its deferred W's hold
        beyond those where the backward is split (`deferred_memory`)."""
        copies = np.asarray(self.schedule.in_flight(n_stages, self.microbatches), dtype=float)
        held = _range_sums(self.state)[None] + copies[:, None, None] * _range_sums(self.act)[None]
        return held + self.deferred_memory(n_stages)

    def deferred_memory(self, n_stages: int) -> np.ndarray:
        """[S, L, L] bytes per device the deferred W's of stage s holding segments i..j
        hold beyond its in-flight microbatches (`_cost/_deferred.py`; 0 where the
        schedule does not split the backward)."""
        L = len(self.state)
        if self.held is None:
            return np.zeros((n_stages, L, L))
        whole, for_w = self.held
        # A stage that runs no B keeps all its residuals for its W's.
        shares = np.where(self._alone(n_stages)[:, :, None], whole[None], for_w[None])
        m = self.microbatches
        return np.stack(deferred_beyond(self.schedule, n_stages, m, [whole] * n_stages, shares))


def _range_sums(x: np.ndarray) -> np.ndarray:
    """[L, L]: the sum of x[i..j]."""
    prefix = np.concatenate([[0.0], np.cumsum(x)])
    return prefix[None, 1:] - prefix[:-1, None]


def _pair_ranges(pairs: np.ndarray) -> np.ndarray:
    """[L, L]: the sum of pairs[a, b] over i <= a <= b <= j, from an [L, L] table of
    amounts counted where a range holds both segments a and b (a <= b)."""
    return np.cumsum(np.cumsum(pairs[::-1], axis=0)[::-1], axis=1)


def _sends_back(graph, split: Partition) -> np.ndarray:
    """[L] some backward value made at or after segment i is read by a backward op
    before it (it crosses every boundary in between); False before the first segment."""
    seg, phase = split.op_stage, split.op_phase
    backward = (Phase.BWD, Phase.WGT)
    crossed = np.zeros(split.n_stages + 1, dtype=np.int64)  # a difference array
    consumers = graph.consumers()
    for op in graph.ops:
        if phase[op.index] not in backward:
            continue
        readers = [seg[c] for t in op.outputs for c in consumers[t] if phase[c] in backward]
        lowest = min(readers, default=seg[op.index])
        if lowest < seg[op.index]:  # boundaries lowest + 1 .. its own segment
            crossed[lowest + 1] += 1
            crossed[seg[op.index] + 1] -= 1
    return np.cumsum(crossed)[:-1] > 0


def _held_ranges(graph, split: Partition, inv, residuals, m: int):
    """(all residuals, W's share) per microbatch of a stage holding segments i..j, each
    [L, L]: a value counted once on a stage that runs one of its readers (and its maker
    where given). With its reader segments r_1 < ... < r_n, the stage holds it iff
    sum_k [r_k in range] - sum_k [r_k and r_k+1 in range] is 1 (those in a range are a
    run), and each term is a pair of segments (a set lies in a range iff its least and
    largest do), with the maker's segment joined to each: a sum over pairs."""
    L, seg = split.n_stages, split.op_stage
    pairs = np.zeros((2, L, L))
    for held in deferred_holds(graph, split, inv, residuals, m):
        on = sorted({seg[c] for c in held.readers})
        fixed = () if held.maker is None else (seg[held.maker],)
        table = pairs[int(held.for_w)]
        for k, r in enumerate(on):
            both = (*fixed, r)
            table[min(both), max(both)] += held.nbytes
            if k + 1 < len(on):
                three = (*both, on[k + 1])
                table[min(three), max(three)] -= held.nbytes
    return _pair_ranges(pairs[0]), _pair_ranges(pairs[1])


def segment_tables(
    model, fine: Partition, oc, microbatches: int, schedule: PipelineSchedule, stages: int
) -> SegmentTables:
    """The tables of `fine` with `oc`'s intra-stage plan, priced by the pipeline cost
    model as `schedule` runs it (its backward split where the schedule splits it), for
    `stages` stages: each boundary's bytes and messages, timed on the link of the cut
    between the S stages' device groups that it becomes (`send_after`), never on the finest
    partition's (as many groups as candidates: across nodes where S stages are not)."""
    pc = stage_costs(model, fine, oc, microbatches, schedule)
    split = split_backward(model.graph, fine) if schedule.splits_backward else fine
    # `pc`'s sends, of `split` on one device group per segment: every message counted;
    # only their bytes and counts are read, timed per cut by `send_after`.
    traffic, L = pc.sends, fine.n_stages
    seg = np.asarray(split.op_stage)
    op_phase = np.asarray([int(p) for p in split.op_phase])
    phases = schedule.phases
    phase_s = np.zeros((L, len(phases)))
    for k, p in enumerate(phases):
        own = np.where(op_phase == p, pc.op_run_s, 0.0)
        if p is Phase.BWD:  # a recomputed forward runs again in the backward
            own = own + pc.op_remat_s
        phase_s[:, k] = np.bincount(seg, own, minlength=L)
    held = None
    if schedule.splits_backward:
        held = _held_ranges(model.graph, split, oc.layouts.inv, model.residuals, microbatches)
    return SegmentTables(
        schedule=schedule,
        microbatches=microbatches,
        phases=phases,
        phase_s=phase_s,
        state=np.bincount(seg, pc.op_state_bytes, minlength=L),
        act=np.bincount(seg, pc.op_act_bytes, minlength=L),
        fwd_bytes=np.append(traffic.fwd_bytes, 0.0),
        fwd_count=np.append(traffic.fwd_count, 0),
        bwd_bytes=np.append(traffic.bwd_bytes, 0.0),
        bwd_count=np.append(traffic.bwd_count, 0),
        # The DP cuts one chunk per device group (`_dp.one_chunk`): S stages, S groups;
        # were they virtual, cut s would still run from stage s's group to the next's.
        links=PipeLinks(model.cluster, oc.mesh, max(1, stages // schedule.chunks)),
        stages=stages,
        sends_back=_sends_back(model.graph, split),
        held=held,
    )


def fill_weight(schedule: PipelineSchedule, stages: int, microbatches: int) -> float:
    """kappa of the DP's objective (M - 1) max tau + kappa sum tau: (1 + idle) / S, so
    that equal stages cost (M + idle) tau, `idle` the schedule's idle slots (1 for GPipe
    and 1F1B, whose idle is S - 1; (S + 2) / 3S for ZB-H1's (S - 1) / 3 when M >= S)."""
    return (1.0 + schedule.idle_slots(stages, microbatches)) / stages


def optimal_cuts(
    model,
    fine: Partition,
    cands,
    oc,
    point: Point,
    schedule: PipelineSchedule,
    memory_limit: float | None = None,
    tables: SegmentTables | None = None,
) -> tuple[int, ...] | None:
    """The stage DP's cuts (ops where stages 1.. start) for one point, None where no
    partition fits under `memory_limit` (the device's by default): `fine`'s segment
    tables (`tables`, made here unless given) summed into (stage, first segment, last
    segment) tables, the DP's objective read from `schedule` (module doc)."""
    m, S = point.microbatches, point.stages
    if tables is None:
        tables = segment_tables(model, fine, oc, m, schedule, S)
    rescore = None
    if schedule.splits_backward:
        per_phase = tables.stage_phase_s(S)

        def rescore(stages) -> float:
            times = [tuple(per_phase[s, i, j - 1]) for s, (i, j) in enumerate(stages)]
            sends = [float(tables.send_after(s)[j - 1]) for s, (_, j) in enumerate(stages[:-1])]
            units = schedule.simulate(S, m, times, sends)
            return max(u.end for u in units)

    sol = optimal_partition(
        tables.stage_time(S),
        m,
        stage_memory=tables.stage_memory(S),
        memory_limit=model.cluster.memory_limit if memory_limit is None else memory_limit,
        fill_weight=fill_weight(schedule, S, m),
        rescore=rescore,
    )
    if not sol.feasible:
        return None
    return tuple(cands[i - 1] for i, _ in sol.stages[1:])
