"""The cost of a pipeline plan: stage times, schedule, bubble, sends and memory per stage.

Built on the cost model of one stage's intra-stage plan (`CostModel`, on the stage mesh):

- `op_costs` prices every op of the step once, for the whole batch in one piece: compute
  seconds, the seconds of the collectives it implies, which of them are gradient
  reductions (XLA combines those into one collective per axis; the step's combined ones
  are shared among their ops by bytes), and ZeRO's all-gathers (on the first op reading
  each parameter). It needs no partition, so a stage DP can price the finest partition
  once and sum ops over any layer segment.
- `stage_costs` turns them into a pipeline's times for any partition (`_partition.py`).
  An op of the per-microbatch phases (FWD, BWD) runs m times on 1/m of the batch: its
  compute and the collectives of tensors carrying the batch shrink to 1/m; a collective
  of a batch-free tensor does not (a gradient all-reduce is full size). PRE and POST run
  once per step on the whole batch.
- an accumulated tensor (a weight's gradient, the loss sum) leaves its F or B call as
  per-device partial sums when there is more than one microbatch, and the runtime
  reduces it once per step, after the stage's last backward, in a "reduce" program of
  its own (`_run/_accumulate.py`): the reduction over the batch's axes of its op moves to a
  fifth phase, REDUCE, run once, full size, combined per stage and axis (one program: as
  XLA's combiner does), and timed after the stage's last unit in the schedule's
  `simulate`. What is left of that reduction (axes that are not the batch's) stays in its call.
  With ZeRO >= 1 that reduction of the gradients is a reduce-scatter into the ZeRO
  layout (where the backend has one), the POST update runs on shards and gathers each
  new parameter once (ZeRO-1/2); with ZeRO-3 the parameters stay sharded, a PRE program
  gathers what it reads, and F and B gather layer by layer as one program does
  (`_zero.add_zero_gathers`, `_fsdp.program_gathers`). Rematerialized forward ops run
  again in B.
- sends (`_sends.py`) are point-to-point, alpha-beta per tensor, each on the link between
  its two stages' device groups (NVLink inside a node, the network across: on a pipe axis
  spanning nodes only some cuts cross it), overlapped with compute: they delay the
  receiver (a lag in `simulate`) but do not occupy the sender. The lag of a cut is the larger of its two directions' sends.
- the step: PRE (stages run theirs concurrently: the slowest) + the simulated schedule's
  makespan (each stage's REDUCE included) + POST. `bubble_s` = step - the busiest stage's
  own work (PRE + m (F + B) + REDUCE + POST); `compute_s` and `comm_s` are that stage's own, so step = compute + comm + bubble
  as for plans without stages. Memory per device is the largest stage's (`_traffic.py`).
- interleaved 1F1B (v = `Plan.virtual_stages` > 1): the stages are virtual, v per device
  group, each timed as a stage in `simulate`; a group's work, collectives and memory
  (`_traffic.stage_memory`) are all its chunks'.

With equal stages and free sends this is the textbook: bubble / step = (S - 1) / (m + S - 1)
for both schedules (`PipelineSchedule.bubble`), as in the exact stage DP
(`_solvers/_pipeline_dp.py`). The DP charges sends to the sending stage's time instead;
the two agree when sends are free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from .._axes import DATA, PIPE
from .._errors import PlanError
from .._graph import Role
from .._pipeline import (
    Partition,
    Phase,
    PipelineSchedule,
    Timed,
    check_remat,
    partition,
    plan_schedule,
    split_backward,
)
from .._plan import Collective, Cost, Plan
from .._remat import full_remat
from . import _collectives as C
from ._beside import split_compute, split_rows
from ._compute import op_compute
from ._kernel import collective_rows, gradients_apart, per_slot
from ._scatter import SCATTERS
from ._sends import PipeLinks, Sends, sends
from ._seqpar import stage_sequence_parallel
from ._stage_comm import N_PHASES, phase_collectives, split_alone
from ._stage_layouts import Layouts, stage_layouts
from ._traffic import StageMemoryInputs, phase_codes, stage_memory
from ._zero import zero_gradient_keys, zero_op_gathers, zero_op_sums


class StageModel(Protocol):
    """What the pipeline cost reads of the one-stage cost model (`CostModel`): the
    program, its groups and tables, and the per-op state of an intra-stage plan. Typed
    by this protocol so that the one-stage model can dispatch to this module without a
    cycle."""

    graph: Any
    cluster: Any
    groups: Any
    tables: Any
    regather: Any  # ZeRO-3's gathers and reductions layer by layer (`RegatherCoefs`)
    coefs: Any  # every term's coefficients per set (`_terms.SetCoefs`)

    def op_state(
        self, assignment: Any, mesh: Mapping[str, int], staged: bool = False
    ) -> tuple[Any, Any]: ...

    def plan_assignment(self, plan: Plan) -> dict[int, str]: ...

    def for_plan(self, plan: Plan) -> Any: ...


@dataclasses.dataclass(frozen=True, eq=False)
class OpCosts:
    """Per-op seconds of an intra-stage plan, the whole batch run once, on the stage mesh.

    `compute + remat_compute + comm + grad_comm + zero_comm`, summed over ops, is what
    `CostModel.evaluate` predicts for the same plan without stages (compute_s + comm_s),
    ZeRO-3's gathers layer by layer included (`_fsdp.program_gathers`, on each gather's
    first reader; tests/test_price_once.py, tests/pipeline/test_cost.py); `stage_costs`
    charges each stage's programs their own (`_zero.add_zero_gathers`).
    The row arrays keep each collective apart, so `stage_costs` can time them exactly on
    a microbatch's bytes and combine gradient reductions per stage.
    """

    mesh: Mapping[str, int]  # the stage mesh
    zero_stage: int
    remat: bool
    compute: np.ndarray  # [n_ops] seconds
    remat_compute: np.ndarray  # [n_ops] seconds a forward op runs again in backward (remat)
    comm: np.ndarray  # [n_ops] seconds of its non-gradient collectives
    grad_comm: np.ndarray  # [n_ops] its share (by bytes) of the combined gradient reductions
    zero_comm: np.ndarray  # [n_ops] ZeRO all-gathers of the parameters it reads first
    layouts: Layouts  # per-device size of every tensor
    row_op: np.ndarray  # [rows] the op of each candidate collective
    row_key: np.ndarray  # [rows] kind * masks + axis mask (see _kernel.py)
    row_bytes: np.ndarray  # [rows] bytes moved for the whole batch (0: inactive)
    row_count: np.ndarray  # [rows] occurrences (0: inactive)
    row_grad: np.ndarray  # [rows] a gradient reduction (combined with the others)
    row_batched: np.ndarray  # [rows] the tensor moved carries the batch dimension
    row_partial: np.ndarray  # [rows] a partial-sum row (the reduction of an op's result)
    batch_mask: int  # axis mask of the axes the batch groups are split on
    zero_mask: int  # axis mask of the data axis ZeRO gathers over (0: no ZeRO)
    axis_costs: C.AxisCosts
    # [rows] a recomputed op's collective run again in the backward (remat), or None.
    row_again: np.ndarray | None = None
    # [rows] a ZeRO gradient a B call that reduces it (one microbatch) all-reduces whole
    # (or None): one with 16-bit elements, which the plan leaves whole, and a lookup's
    # (`_whole_in_backward`); a stage's reduce program scatters them all the same
    # (`_stage_comm.rows_by_phase`).
    row_whole: np.ndarray | None = None
    # [rows] XLA's split of a gradient dot beside ZeRO's data axis (`_beside.py`), or None:
    # 1 its pieces' rows, 2 the reduce-scatter they replace, where a call reduces the
    # gradient it makes; a stage's reduce program scatters it (`_stage_comm.rows_by_phase`)
    row_split: np.ndarray | None = None
    # [n_ops] the compute `compute` leaves out of the dots XLA splits so (`_beside.py`):
    # a stage whose B calls do not reduce the gradients they make runs them whole
    split_compute: np.ndarray | None = None

    @property
    def total(self) -> np.ndarray:
        """[n_ops] seconds of each op, everything included."""
        return self.compute + self.remat_compute + self.comm + self.grad_comm + self.zero_comm


def leaf_bytes(
    model: StageModel, assignment: Mapping[int, str | None], stage_mesh: Mapping[str, int]
) -> tuple[float, float]:
    """(parameter, optimizer-state) bytes per device of the leaves the step reads, split
    as `assignment` lays them out on `stage_mesh` before any ZeRO split: what a searcher
    bounds a point's stored state by without pricing its ops (`op_costs`)."""
    graph = model.graph
    st, _ = model.op_state(assignment, stage_mesh, True)
    data_axis = DATA if DATA in stage_mesh else None
    lay = stage_layouts(graph, model.groups.tensor_groups, st.codes, stage_mesh, data_axis)
    consumers = graph.consumers()
    sums = dict.fromkeys((Role.PARAM, Role.OPT_STATE), 0.0)
    for leaf in graph.inputs:
        if leaf.role in sums and consumers[leaf.tensor]:
            sums[leaf.role] += graph.tensors[leaf.tensor].nbytes * float(lay.inv[leaf.tensor])
    return sums[Role.PARAM], sums[Role.OPT_STATE]


def op_costs(
    model: StageModel,
    assignment: Mapping[int, str | None],
    stage_mesh: Mapping[str, int],
    *,
    zero_stage: int = 0,
    remat: bool = False,
    data_axis: str | None = None,
    staged: bool = True,
) -> OpCosts:
    """Price every op once under `assignment` on `stage_mesh` (see `OpCosts`). `staged`:
    for a pipeline of two stages or more, whose programs cannot add partial sums made on
    two stages before reducing them (a tied embedding's); False for one stage."""
    graph, T = model.graph, model.tables
    if data_axis is None:
        data_axis = DATA if DATA in stage_mesh else None
    # One program under ZeRO-3 reduce-scatters a tied table's gradient parts apart, as two
    # stages do (`Tables.tied_partial`, what `CostModel.estimate` adds): its rows apart.
    apart = staged or (
        zero_stage >= 3
        and model.cluster.lowering.reduce_scatter
        and stage_mesh.get(data_axis, 1) > 1
    )
    st, ac = model.op_state(assignment, stage_mesh, apart)
    n = len(graph.ops)
    compute = op_compute(T, st.inv)
    # Rematerialization runs every op of the recomputed layers again, matmuls included:
    # `op_coef` prices the recompute, `remat_op_coef` the lighter first forward.
    remat_compute = op_compute(T, st.inv, remat=True) if remat else np.zeros(n)
    pf, rf = (T.staged_partial_full if apart else T.partial_full), T.reshard_full
    row_op = np.concatenate([per_slot(pf, pf.op), rf.op])
    # The update's own sums (`_tables.combine_update_sums`: a combine slot, not a
    # gradient) are combined in their stage's program as the gradients are.
    grads = per_slot(pf, pf.grad | (pf.combine > 0)) & ~gradients_apart(
        pf, st.codes[pf.group], st.P
    )
    row_grad = np.concatenate([grads, rf.grad])
    tset = np.concatenate([per_slot(pf, pf.tset), rf.tset])
    row_batched = np.isin(T.sets[tset], model.groups.batch_groups).any(axis=1)
    lay = stage_layouts(graph, model.groups.tensor_groups, st.codes, stage_mesh, data_axis)
    zero_mask, zero_comm, key = 0, np.zeros(n), st.key
    if zero_stage >= 1 and lay.data_size > 1:
        d = list(stage_mesh).index(data_axis) + 1
        zero_mask = int(ac.bit[d])
        # The update and the gradients the data axis does not already split run on
        # ZeRO's shards, as for one stage (`_terms.compute_time`).
        compute = op_compute(T, st.inv, zero=(st.P, d, lay.data_size))
        key = zero_gradient_keys(model.cluster.lowering, ac, row_grad, key, zero_mask)
        # One program (not `staged`) gathers a mixed-precision step's casts (`_terms.py`).
        zero_comm = zero_op_gathers(model, lay, ac, zero_mask, zero_stage, remat, not staged)
        zero_comm = zero_comm + zero_op_sums(
            model.graph, model.coefs.reductions, lay, ac, zero_mask
        )
    nbytes, count, time, row_split = st.nbytes, st.count, st.time, None
    row_partial = np.arange(len(row_op)) < len(row_op) - len(rf.op)
    split = split_rows(model.beside, st, ac, d) if zero_mask else None
    split_saved = None
    if split is not None:  # XLA's split of gradient dots beside data: rows of their own
        split_saved = np.zeros(n)  # ... and its dots on their 1/n pieces
        split_saved[split.ops] = split_compute(compute[split.ops], lay.data_size)
        compute = compute - split_saved
        row_split = np.concatenate([np.where(split.gone, 2, 0), np.ones(len(split.key), int)])
        new = (split.key, split.nbytes, split.count, split.grad, ~split.grad, True)
        old = (key, nbytes, count, row_grad, np.zeros(len(key), bool), row_partial)
        key, nbytes, count, row_grad, permute, row_partial = (
            np.concatenate([a, np.broadcast_to(b, split.source.shape)])
            for a, b in zip(old, new, strict=True)
        )
        row_op, row_batched = (np.concatenate([x, x[split.source]]) for x in (row_op, row_batched))
        time = np.concatenate([time, np.zeros(len(split.key))])
        time = np.where(permute, ac.by_key(key, nbytes, count), time)
    # Gradient reductions are one collective per (kind, axes) for the step: shared by bytes.
    g = row_grad & (count > 0) & ((row_split != 2) if row_split is not None else True)
    g_bytes = np.bincount(key[g], nbytes[g], minlength=len(ac.keys))
    g_any = np.bincount(key[g], minlength=len(ac.keys)) > 0
    trips = g_any * _reductions(model, zero_mask, zero_stage, staged)
    g_time = np.where(g_any, ac.by_key(ac.keys, g_bytes, trips), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(g, nbytes / g_bytes[key] * g_time[key], 0.0)
    oc = OpCosts(
        mesh=dict(stage_mesh),
        zero_stage=zero_stage,
        remat=bool(remat),
        compute=compute,
        remat_compute=remat_compute,
        comm=np.bincount(row_op, time, minlength=n),
        grad_comm=np.bincount(row_op, np.nan_to_num(share), minlength=n),
        zero_comm=zero_comm,
        layouts=lay,
        row_op=row_op,
        row_key=key,
        row_bytes=nbytes,
        row_count=count,
        row_grad=row_grad,
        row_batched=row_batched,
        row_partial=row_partial,
        batch_mask=int(np.bitwise_or.reduce(ac.bit[st.codes[list(model.groups.batch_groups)]]))
        if model.groups.batch_groups
        else 0,
        zero_mask=zero_mask,
        axis_costs=ac,
        row_whole=_whole_in_backward(graph)[row_op],  # one check per op, not per row
        row_split=row_split,
        split_compute=split_saved,
    )
    return _with_recomputed_rows(model, oc, st) if remat else oc


def _reductions(model: StageModel, zero_mask: int, zero_stage: int, staged: bool) -> float:
    """The collectives each gradient reduction is made in: one for the step, but one per
    backward layer where one program's ZeRO-3 reduces them layer by layer (as
    `_terms.gradient_trips`, from `_fsdp.reduction_shares`). A pipeline stage sums its
    gradients over the microbatches and reduces them once per step (`_accumulate.py`)."""
    layers = model.regather.layers
    if staged or not zero_mask or zero_stage < 3 or layers is None:
        return 1.0
    return float(layers.reductions)


def _whole_in_backward(graph) -> np.ndarray:
    """[n_ops] the op's (first) result has 16-bit elements, or it is a table lookup's
    gradient (a scatter-add): a stage's B call that reduces such a ZeRO gradient
    all-reduces it whole. The lookup's read on 2 GPipe stages at data 4, one microbatch,
    ZeRO-1: a float32 GPT's tied table (its lookup part, stage 0) and a float32 Llama's
    token table, 1 MiB each, all-reduced whole, on v5p 2x2x2 and A100s alike; with two
    microbatches the reduce program reduce-scatters it (tests/test_verify_tpu.py)."""
    return np.array(
        [
            bool(op.outputs)
            and (graph.tensors[op.outputs[0]].itemsize < 4 or op.primitive in SCATTERS)
            for op in graph.ops
        ],
        dtype=bool,
    )


def _with_recomputed_rows(model: StageModel, oc: OpCosts, st) -> OpCosts:
    """`oc` with the recomputed ops' collectives added as rows of their own (`row_again`),
    which `stage_costs` times in the backward, where the recompute runs them."""
    T, ac = model.tables, oc.axis_costs
    p, r = T.remat_partial, T.remat_reshard
    key, nbytes, count, grad, time = collective_rows(
        p, r, st.codes, st.P, st.inv, ac, 1, model.cluster.lowering
    )
    op = np.concatenate([per_slot(p, p.op), r.op])
    tset = np.concatenate([per_slot(p, p.tset), r.tset])
    batched = np.isin(T.sets[tset], model.groups.batch_groups).any(axis=1)
    n = len(model.graph.ops)
    return dataclasses.replace(
        oc,
        comm=oc.comm + np.bincount(op, np.where(grad, 0.0, time), minlength=n),
        row_op=np.concatenate([oc.row_op, op]),
        row_key=np.concatenate([oc.row_key, key]),
        row_bytes=np.concatenate([oc.row_bytes, nbytes]),
        row_count=np.concatenate([oc.row_count, count]),
        row_grad=np.concatenate([oc.row_grad, grad]),
        row_batched=np.concatenate([oc.row_batched, batched]),
        row_again=np.arange(len(oc.row_op) + len(op)) >= len(oc.row_op),
        # Partial-sum rows of forward ops: never an accumulated tensor's, never deferred.
        row_partial=np.concatenate([oc.row_partial, np.arange(len(op)) < len(op) - len(r.op)]),
        row_whole=np.concatenate([oc.row_whole, np.zeros(len(op), dtype=bool)]),
        row_split=None if oc.row_split is None else np.concatenate([oc.row_split, 0 * op]),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineCost:
    """A pipeline plan's predicted schedule, per stage and per op."""

    schedule: PipelineSchedule
    microbatches: int
    # per stage (fwd, bwd) s per microbatch; (fwd, B, W) where the schedule splits bwd
    stage_times: tuple[tuple[float, ...], ...]
    send_s: tuple[float, ...]  # per cut, the lag of a microbatch crossing it (s)
    sends: Sends  # the traffic behind send_s, and the once-per-step sends
    stage_pre_s: tuple[float, ...]  # per stage, once per step before the microbatches
    stage_post_s: tuple[float, ...]  # per stage, once per step after them
    pre_s: float  # the slowest stage's PRE (stages run theirs concurrently)
    post_s: float
    stage_work_s: tuple[float, ...]  # per stage, its device group's work per step (no idle)
    stage_memory: tuple[Mapping[str, float], ...]  # per stage, breakdown per device
    stage_memory_bytes: tuple[float, ...]
    # microbatches of activations each stage holds at its devices' peak
    in_flight: tuple[int, ...]
    ops: tuple[Timed, ...]  # `PipelineSchedule.simulate`'s forward and backward units
    # its once-per-step units: (stage, Phase.REDUCE, -1, start, end), a stage's gradient
    # reduction after its last backward (none with one microbatch)
    reduce_ops: tuple[Timed, ...]
    # [n_ops] s per run: per microbatch (fwd/bwd ops), per step (pre/post); an op's share of
    # its stage's once-per-step REDUCE counts 1/m of it per microbatch
    op_run_s: np.ndarray
    op_remat_s: np.ndarray  # [n_ops] s per microbatch a forward op runs again in backward
    # [n_ops] bytes a stage holds once per step: param + grad + optimizer bytes of the
    # leaves an op reads first, the once-made values it reads first, the residuals it makes
    # once per step (a weight's cast the backward reads)
    op_state_bytes: np.ndarray
    op_act_bytes: np.ndarray  # [n_ops] bytes per device per microbatch of residuals it makes
    cost: Cost  # its collectives are the busiest stage's (per device), sends included
    # Per stage, its collectives per device per step, sends left out: what `am.verify`
    # holds against the XLA programs each stage runs.
    stage_collectives: tuple[tuple[Collective, ...], ...] = ()


def stage_costs(
    model: StageModel,
    part: Partition,
    oc: OpCosts,
    microbatches: int,
    schedule: PipelineSchedule,
) -> PipelineCost:
    """Time and memory of a pipeline: `part` (any partition) with `oc`'s intra-stage plan
    on every stage, `microbatches` microbatches run in `schedule`."""
    graph, cluster = model.graph, model.cluster
    check_remat(schedule, oc.remat)  # a split backward does not recompute: one line
    if schedule.splits_backward:  # ZB-H1: each stage's weight gradients a W of their own
        part = split_backward(graph, part)
    S, m = part.n_stages, max(1, int(microbatches))
    G = S // schedule.chunks  # device groups (S virtual stages when interleaved)
    stage, phase = np.array(part.op_stage), phase_codes(part)
    per_mb = np.isin(phase, [p for p in Phase if p.per_microbatch])
    runs = np.array([m if p.per_microbatch else 1 for p in Phase])  # runs per step
    op_compute = oc.compute / np.where(per_mb, m, 1)
    if oc.split_compute is not None:  # the dots XLA splits only where a call reduces
        whole = ~split_alone(graph, part, m)
        op_compute = op_compute + np.where(whole, oc.split_compute, 0.0) / np.where(per_mb, m, 1)
    op_remat = np.where(phase == Phase.FWD, oc.remat_compute / m, 0.0)
    comm = phase_collectives(model, part, oc, per_mb, m)
    compute = np.bincount(stage * N_PHASES + phase, op_compute, minlength=S * N_PHASES)
    compute = compute.reshape(S, N_PHASES)
    compute[:, Phase.BWD] += np.bincount(stage, op_remat, minlength=S)
    busy = compute + comm.time.sum(axis=2)  # [S, N_PHASES] seconds per run
    # Each message on its own cut's link; with one device group (every stage a chunk of
    # it) none leaves its devices.
    traffic = sends(graph, part, oc.layouts, PipeLinks(cluster, oc.mesh, G), m)
    send_s = tuple(max(f, b) for f, b in zip(traffic.fwd_s, traffic.bwd_s, strict=True))
    times = [tuple(float(busy[s, p]) for p in schedule.phases) for s in range(S)]
    units = schedule.simulate(G, m, times, send_s, busy[:, Phase.REDUCE])
    stage_pre = busy[:, Phase.PRE] + np.array(traffic.pre_s)
    stage_post = busy[:, Phase.POST] + np.array(traffic.post_s)
    # A device group's own work is all its chunks' (one stage each unless interleaved):
    # it runs their once-per-step programs one after another.
    group = np.arange(S) % G
    pre = float(np.bincount(group, stage_pre, minlength=G).max())
    post = float(np.bincount(group, stage_post, minlength=G).max())
    own = stage_pre + m * busy[:, list(schedule.phases)].sum(axis=1) + busy[:, Phase.REDUCE]
    own = np.bincount(group, own + stage_post, minlength=G)
    memory, op_state, op_act = stage_memory(_memory_inputs(model, part, oc, m, schedule))
    step = pre + max(end for *_, end in units) + post
    b = int(np.argmax(own))
    mine = group == b
    op_s = (op_compute * runs[phase]).tolist(), (comm.op * runs[phase] + comm.op_reduce).tolist()
    per_op = tuple(zip(range(len(phase)), *op_s, strict=True))
    cost = _pipeline_cost(
        model,
        oc,
        step,
        float(compute[mine].sum(axis=0) @ runs),
        float(own[b]),
        memory,
        per_op,
        comm.per_step(oc.axis_costs, mine, runs) + _sent(traffic, mine, G),
        G,
    )
    return PipelineCost(
        schedule=schedule,
        microbatches=m,
        stage_times=tuple(times),
        send_s=send_s,
        sends=traffic,
        stage_pre_s=tuple(float(x) for x in stage_pre),
        stage_post_s=tuple(float(x) for x in stage_post),
        pre_s=pre,
        post_s=post,
        stage_work_s=tuple(float(own[g]) for g in group),
        stage_memory=tuple(memory),
        stage_memory_bytes=tuple(float(sum(d.values())) for d in memory),
        in_flight=schedule.stage_in_flight(G, m),
        ops=tuple(u for u in units if u.phase is not Phase.REDUCE),
        reduce_ops=tuple(u for u in units if u.phase is Phase.REDUCE),
        # A once-per-step reduction spread over the runs: what a stage DP adds per unit.
        op_run_s=op_compute + comm.op + comm.op_reduce / runs[phase],
        op_remat_s=op_remat,
        op_state_bytes=op_state,
        op_act_bytes=op_act,
        cost=cost,
        stage_collectives=tuple(
            comm.per_step(oc.axis_costs, np.arange(S) == s, runs) for s in range(S)
        ),
    )


def _memory_inputs(model: StageModel, part, oc: OpCosts, m: int, schedule) -> StageMemoryInputs:
    """What `stage_memory` reads of a pipeline priced with `oc`'s intra-stage plan."""
    return StageMemoryInputs(
        model.graph,
        part,
        oc.layouts,
        model.residuals,
        microbatches=m,
        schedule=schedule,
        zero_stage=oc.zero_stage,
        remat=oc.remat,
        lowering=model.cluster.lowering,
        layer_stored=model.layer_stored if oc.remat else (),
        late=late_ops(model, part, oc, m),
        layers=model.tables.layers,
        gathered=model.tables.gathered,
        gathered_narrow=model.tables.gathered_narrow,
    )


def late_ops(model: StageModel, part, oc: OpCosts, m: int) -> frozenset[int]:
    """The weight-gradient dots XLA splits beside data (`_beside.py`) in a B program that
    reduces them, which it runs at the program's end (`Lowering.late_split_dots`)."""
    if oc.split_compute is None or not model.cluster.lowering.late_split_dots:
        return frozenset()
    split = (oc.split_compute > 0) & split_alone(model.graph, part, m)
    return frozenset(np.flatnonzero(split & (phase_codes(part) == Phase.BWD)).tolist())


def _pipeline_cost(
    model, oc: OpCosts, step, compute_s, own_s, memory, per_op, collectives, groups: int
):
    """The pipeline's `Cost`: the busiest device group's own compute and communication
    (`own_s` its work per step), the rest of the step its bubble; memory the largest
    stage's (a virtual stage's is its device group's)."""
    cluster, graph = model.cluster, model.graph
    totals = [sum(d.values()) for d in memory]
    worst = int(np.argmax(totals))
    limit = cluster.memory_limit
    reason = ""
    if totals[worst] > limit:
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in memory[worst].items())
        reason = (
            f"pipeline stage {worst} needs {totals[worst] / 1e9:.2f} GB per device ({parts}) "
            f"but {cluster.name} has {limit / 1e9:.2f} GB usable"
        )
    devices = groups * (math.prod(oc.mesh.values()) if oc.mesh else 1)
    return Cost(
        step_time_s=step,
        compute_s=compute_s,
        comm_s=own_s - compute_s,
        bubble_s=step - own_s,
        memory_bytes=float(totals[worst]),
        mfu=graph.total_flops / (step * cluster.peak_flops * devices) if step > 0 else 0.0,
        feasible=bool(totals[worst] <= limit),
        reason=reason,
        memory_limit_bytes=limit,
        memory_breakdown=dict(memory[worst]),
        collectives=collectives,
        per_op=per_op,
    )


def _sent(traffic: Sends, mine: np.ndarray, groups: int) -> tuple[Collective, ...]:
    """The sends of the stages `mine` (a device group's) as one collective over the pipe
    axis; none if none, or with one group (its chunks share the devices)."""
    nbytes, count, seconds = (float(np.asarray(x)[mine].sum()) for x in traffic.sent)
    if not count or groups == 1:
        return ()
    return (Collective("collective-permute", PIPE, nbytes, int(count), seconds),)


def estimate_pipeline(model: StageModel, plan: Plan) -> PipelineCost:
    """The pipeline cost of a plan with stages: `plan.mesh` is {"pipe": S, **stage mesh},
    its specs are on the stage mesh, `plan.stages` cut the forward ops."""
    # A plan recomputing less than every layer in full: priced on its own `Recompute`.
    model, plan = model.for_plan(plan), full_remat(plan)
    stage_mesh = {k: v for k, v in plan.mesh.items() if k != PIPE}
    for s, st in enumerate(plan.stages):
        if st.mesh and dict(st.mesh) != stage_mesh:
            raise PlanError(
                f"pipeline stage {s} has mesh {dict(st.mesh)}, but the plan's stage mesh is "
                f"{stage_mesh} (its mesh without 'pipe'): every stage runs the same "
                "intra-stage plan on a mesh of the same shape. Fix the plan's stages."
            )
    bounds = [(st.op_start, st.op_stop) for st in plan.stages]
    part = partition(model.graph, model.groups, bounds, plan.microbatches)
    schedule = plan_schedule(plan)  # refuses what it cannot run (a split backward's remat)
    return stage_costs(model, part, plan_op_costs(model, plan), plan.microbatches, schedule)


def plan_op_costs(model: StageModel, plan: Plan) -> OpCosts:
    """`op_costs` of a pipeline plan's intra-stage plan (its assignment, stage mesh, ZeRO
    stage and rematerialization)."""
    oc = op_costs(
        model,
        model.plan_assignment(plan),
        {k: v for k, v in plan.mesh.items() if k != PIPE},
        zero_stage=plan.zero_stage,
        remat=plan.remat,
        staged=len(plan.stages) > 1 or plan.microbatches > 1,
    )
    return stage_sequence_parallel(model, plan, oc) if plan.sequence_parallel else oc


def pipeline_decisions(pc: PipelineCost) -> dict[str, Any]:
    """Plan decisions the report reads (`_report.stage_times` and `memory_bars`):
    per stage (fwd, bwd) seconds per microbatch, (fwd, B, W) where the backward is split,
    and the memory breakdown per device."""
    return {
        "stage_times": [list(t) for t in pc.stage_times],
        "stage_memory": [dict(d) for d in pc.stage_memory],
    }
