"""The `dp` searcher: hybrid data x tensor x pipeline plans, stage cuts solved exactly.

The hybrid space has two levels. The outer one is small and enumerated: the stage count
S (a divisor of the device count), the stage mesh (data x model over the remaining devices,
tensor parallel inside a node), the microbatch count, the ZeRO stage and
rematerialization. For each point the intra-stage plan is the ILP optimum of the stage mesh
(time only: memory is the pipeline's business) or the Megatron x data expert assignment,
and the inner level, where the cuts go, is the exact stage DP (`_solvers/_pipeline_dp.py`)
over the cut candidates, with per-segment tables read from the pipeline cost model. Every
partition the DP returns is priced again by the full pipeline model, which is what ranks
them. The DP tries ZeRO and rematerialization as memory savers, only where the plain point
has no partition that fits; ZeRO as a time decision (the update on shards) is the
polish's (below). A 1F1B search cuts each point for ZB-H1 too (each backward split into B
and W, the W's deferred into the drain: `dp_schedules`), the DP's tables then timing F, B
and W apart (`_cut_tables.py`), and keeps the faster.

Exact within a point in the DP's objective (per-microbatch stage time plus its sends). That
objective leaves out what happens once per step (a tied embedding sent between its stages,
the slowest stage's update), so the best few partitions are then polished against the
whole model: tried with the decisions the DP does not make (sequence parallelism,
selective recomputation, interleaving, ZB-H1 on 1F1B's cuts, then ZeRO stages:
`_techniques.py`), then one cut moved at a time. Once a plan is found the points leave
`POLISH_SHARE` of the budget to that (a point's memory savers stop there too).

Large models: the points are searched by the memory savers their stored state needs
(`search_shapes`, `fitting_savers`: a shape or intra-stage plan whose parameters, gradients and
optimizer state alone overflow a device is not priced) and most microbatches first, so a
1T GPT's budget goes where its plans can fit. The
outer enumeration is complete unless the budget runs out (the stats say so); the
intra-stage plan is the same on every stage (Alpa's per-stage ILP, `optimal_two_level`,
is not used here).
"""

from __future__ import annotations

import dataclasses
import time as _time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._axes import DATA, MODEL, PIPE
from .._cost import (
    estimate_pipeline,
    leaf_bytes,
    op_costs,
    pipeline_decisions,
    plan_op_costs,
    stage_costs,
)
from .._errors import PlanError
from .._graph import Graph
from .._groups import sequence_parallel
from .._pipeline import (
    PipelineSchedule,
    cut_candidates,
    partition,
    pipeline_plan,
    pipeline_schedule,
    scanned_layers,
)
from .._plan import Plan
from .._remat import aligned_cuts, layer_spans
from .._solvers import Solution, solve_ilp
from .._space import (
    Point,
    ShardSpace,
    StateBytes,
    axis_assignment,
    batch_groups,
    block_groups,
    candidate_meshes,
    microbatch_counts,
    stage_counts,
    state_bytes,
)
from ._cut_tables import optimal_cuts, segment_tables
from ._mesh_terms import COLUMNS_PER_SECOND, MAX_COLUMNS, MIN_COLUMNS, MeshTerms, TooLarge
from ._techniques import dp_schedules, polish_techniques
from ._work import OPS_PER_SECOND, Work

#: How many of the best points' partitions are polished against the whole model.
POLISHED = 3
#: The share of the budget the points leave to polishing the best plans once one is
#: found: a 175B GPT's points could spend it all, where the polish's sequence
#: parallelism, selective recomputation and interleaving take a quarter off the step.
POLISH_SHARE = 0.3
#: Cuts made again under a lower limit where the whole model puts the DP's over it.
REFITS = 2
#: (ZeRO stage, remat) tried in turn when the plain point does not fit.
MEMORY_SAVERS = ((0, False), (1, False), (0, True), (1, True), (3, True))


def one_chunk(schedule: PipelineSchedule) -> None:
    """The stage DP and the pricer cut one chunk per device group: a schedule of virtual
    stages is refused in one line rather than priced as if each chunk had its own devices."""
    if schedule.chunks > 1:
        raise PlanError(
            f"the pipeline search's stage DP cuts one stage per device group; schedule "
            f"{schedule.name!r} runs {schedule.chunks} chunks per group: search with "
            "schedule '1f1b' (the dp and dqn searchers then try interleaving, v = 2 or 3, "
            "on chunks of equal layers), or price an interleaved configuration with am.Recipe(schedule="
            "'interleaved', virtual_stages=V) or `automap estimate --virtual-stages V`."
        )


def search_dp(
    problem: Any,
    budget_s: float = 60.0,
    schedule: str = "1f1b",
    on_point: Callable[[Plan | None, float], None] | None = None,
) -> tuple[Plan | None, dict[str, Any]]:
    """The best pipeline plan of the hybrid space (None when no point fits) and stats.

    `budget_s` is counted as work (`OPS_PER_SECOND`): the same budget gives the same plan
    on any machine; the search stops after the outer point, or the polish step, that spends
    it, or at the wall-clock safety stop: then the stats say `complete` False (never True
    for a search cut short: with no plan, that would read as a proof that none fits)."""
    graph, groups, model = problem.graph, problem.groups, problem.cost_model
    the_schedule = pipeline_schedule(schedule)
    one_chunk(the_schedule)
    schedules = dp_schedules(the_schedule)
    start = _time.perf_counter()
    work = Work(budget_s)
    cands = cut_candidates(graph, groups)
    stats: dict[str, Any] = {"cut_candidates": len(cands), "points": 0, "complete": True}
    if notes := pipeline_notes(graph):
        stats["notes"] = list(notes)
    if not cands or groups.batch_size is None:
        return None, stats
    grids, whole, microbatching = _grids(graph, groups, cands, stats)
    batch = groups.batch_size
    state = state_bytes(graph, groups)
    found: list[Plan] = []
    best: Plan | None = None
    best_time = np.inf
    polish_from = (1 - POLISH_SHARE) * work.limit
    try:
        points = _points(model, cands, batch, microbatching, state, work, stats)
        for point, assignment, savers in points:
            if work.spent() or (found and work.done >= polish_from):
                stats["complete"] = False
                break
            stats["points"] += 1
            # With a plan found, a point's memory savers stop at the polish's share too:
            # on SC'21's 1.7B row a last point through all five took it all.
            until = polish_from if found else None
            plan, cut_short = _solve_point(
                model, grids, point, assignment, schedules, savers, work, until
            )
            if cut_short:
                stats["complete"] = False
            if plan is not None:
                found.append(plan)
                if plan.predicted.step_time_s < best_time:
                    best, best_time = plan, plan.predicted.step_time_s
            if on_point is not None:
                on_point(plan, best_time)
        # The DP's objective leaves out what happens once per step (a tied embedding sent
        # between its stages, the slowest stage's update) and the techniques it does not
        # choose: the best few are polished against the whole model.
        for plan in sorted(found, key=lambda p: p.predicted.step_time_s)[:POLISHED]:
            if work.spent():
                break
            # The techniques first (`_techniques.py`: a quarter of a 175B GPT's step), then
            # the cuts one at a time (a round of moves costs two passes over the program a
            # cut: on a 175B GPT it took the budget the techniques needed).
            plan = polish_techniques(model, plan, whole, work=work)
            if plan.virtual_stages == 1:
                plan = polish_cuts(model, plan, grids[plan.remat][1], work=work)
            if plan.predicted.step_time_s < best_time:
                best, best_time = plan, plan.predicted.step_time_s
        if found and work.spent():  # the polish stopped on it, between plans or in a step
            stats["complete"] = False  # (with nothing found there was nothing to polish)
    except KeyboardInterrupt:
        # Ctrl-C keeps the best pipeline so far.
        if best is None:
            raise
        stats["complete"], stats["interrupted"] = False, True
    stats["work"] = round(work.done)
    return best, _finish(stats, start, best_time)


def _grids(graph: Graph, groups, cands, stats: dict[str, Any]):
    """The finest partitions the DP cuts from, without and with remat ({remat: (partition,
    cut candidates)}), the cuts between layers, and whether the step may be microbatched
    (if not, `stats` says why)."""
    bounds = list(zip((0, *cands), (*cands, len(graph.ops)), strict=True))
    fine = partition(graph, groups, bounds, 1)
    # Under remat, stages start between layers only (Megatron's cuts): a cut inside one
    # would split its recompute unit, a plan the cost model prices on a model of its own.
    whole = aligned_cuts(cands, layer_spans(graph, groups))
    grids = {False: (fine, cands), True: (fine, cands)}
    if whole != cands and whole:
        wb = list(zip((0, *whole), (*whole, len(graph.ops)), strict=True))
        grids[True] = (partition(graph, groups, wb, 1), whole)
    try:
        partition(graph, groups, bounds, 2)
        microbatching = True
    except PlanError as e:  # batch norm and the like: one microbatch only
        microbatching, stats["microbatching"] = False, str(e)
    return grids, whole, microbatching


def pipeline_notes(graph: Graph) -> tuple[str, ...]:
    """What limits the pipelines of this program, for the plan's provenance: layers in one
    scan, which the stage cuts (between top-level ops) cannot split."""
    stack = scanned_layers(graph)
    if stack is None:
        return ()
    return (f"pipelines can only cut around the layers: {stack.why_no_cuts()}",)


def _points(
    model,
    cands: tuple[int, ...],
    batch: int,
    microbatching: bool,
    state: StateBytes | None,
    work=None,
    stats=None,
):
    """The outer level, (point, intra-stage assignment, the memory savers worth pricing
    there) by stage count, stage mesh, intra-stage plan and microbatch count: the shapes
    (stage count and mesh) whose state fits with the fewest memory savers first
    (`search_shapes`), then fewest stages. An intra-stage assignment whose own stored state
    (`leaf_bytes`: the time optimum may replicate a 175B GPT's 134 GB of parameters a
    stage) fits under no saver is left out, its points unpriced."""
    graph, groups, cluster = model.graph, model.groups, model.cluster
    spaces: dict[int, ShardSpace] = {}
    for S, mesh_index, mesh in search_shapes(model, len(cands), state, stats):
        if work is not None and work.spent():
            # Stopped before this mesh's points were made: the search loop never
            # sees them, so the stop is recorded here (a search with no plan that
            # said complete would read as a proof that nothing fits).
            if stats is not None:
                stats["complete"] = False
            return
        per_stage = cluster.devices // S
        if S not in spaces:
            spaces[S] = ShardSpace(graph, groups, cluster.with_devices(per_stage), model)
        for intra, assignment in _intra_plans(spaces[S], mesh_index, mesh, work, stats).items():
            laid = StateBytes(*leaf_bytes(model, assignment, mesh))
            # Already split as laid out (model axis included): ZeRO may split it further.
            savers = fitting_savers(laid, S, {DATA: mesh.get(DATA, 1)}, cluster.memory_limit)
            if not savers:
                if stats is not None:
                    stats["state_overflows"] = stats.get("state_overflows", 0) + 1
                continue
            # Most microbatches first: the least bubble and the fewest activations in
            # flight, where a model too large to search whole within the budget fits.
            for m in reversed(microbatch_counts(batch, mesh.get(DATA, 1), S, microbatching)):
                yield Point(S, mesh, m, intra), assignment, savers


def search_shapes(
    model, cands: int, state: StateBytes | None, stats=None
) -> list[tuple[int, int, dict[str, int]]]:
    """(stage count, mesh index, stage mesh) in the order the DP searches them: by the
    first memory saver whose stored state may fit (`fitting_savers`), then by stage
    count. A small model fits plain everywhere and is searched fewest stages first; a 1T
    GPT's state fits plain on 32 stages or more of tensor parallel 8, and those are
    searched before the fewer stages only ZeRO-3 might fit, whose points would spend the
    budget on prices that cannot win. A shape where no saver may fit is left out (a
    proof, so the search stays complete); `stats["state_overflows"]` counts them."""
    cluster = model.cluster
    shapes = []
    for S in stage_counts(cluster.devices, cands, cluster.devices_per_node):
        for mesh_index, mesh in enumerate(candidate_meshes(cluster.devices // S)):
            if mesh.get(MODEL, 1) > cluster.devices_per_node:
                continue  # tensor parallel across nodes: never worth it
            savers = fitting_savers(state, S, mesh, cluster.memory_limit)
            if not savers:
                if stats is not None:
                    stats["state_overflows"] = stats.get("state_overflows", 0) + 1
                continue
            shapes.append((MEMORY_SAVERS.index(savers[0]), S, mesh_index, mesh))
    return [(S, i, mesh) for _, S, i, mesh in sorted(shapes, key=lambda t: t[:3])]


def fitting_savers(
    state: StateBytes | None, stages: int, mesh: dict[str, int], limit: float
) -> tuple[tuple[int, bool], ...]:
    """The memory savers (ZeRO stage, remat) of `MEMORY_SAVERS` worth pricing at this
    shape: those whose stored state alone (`StateBytes.floor`) is within the memory
    limit, ZeRO only with a data axis. Every one where the state is unknown (None)."""
    data = mesh.get(DATA, 1)
    return tuple(
        (zero, remat)
        for zero, remat in MEMORY_SAVERS
        if not (zero and data == 1)
        and (state is None or state.floor(stages, mesh.get(MODEL, 1), data, zero) <= limit)
    )


def _intra_plans(
    space: ShardSpace, mesh_index: int, mesh: dict[str, int], work=None, stats=None
) -> dict[str, dict]:
    """Intra-stage assignments worth a pipeline: the stage mesh's time optimum and the
    Megatron x data expert (kept apart when they differ). A stage mesh whose MILP is
    larger than the budget affords (`_mesh_terms.COLUMNS_PER_SECOND`) keeps the expert only."""
    groups = space.groups
    out: dict[str, dict] = {}
    budget = np.inf if work is None else work.budget_s
    cap = min(max(COLUMNS_PER_SECOND * budget / 8, MIN_COLUMNS), MAX_COLUMNS)
    try:
        terms = MeshTerms(space, mesh_index, max_columns=cap)
    except TooLarge:
        terms = None
        if stats is not None:
            stats["complete"] = False
            stats.setdefault("ilp_skipped", []).append(dict(mesh))
    if terms is not None:
        solution = _stage_optimum(terms, work)
        if not (solution.optimal or solution.status == "infeasible") and stats is not None:
            stats["complete"] = False  # the budget (or the safety stop) ended it first
        if solution.feasible:
            out["ilp"] = space.assignment(solution.choices[: len(space.units)])
    expert = {
        **axis_assignment(batch_groups(groups), DATA, mesh.get(DATA, 1)),
        **axis_assignment(block_groups(groups), MODEL, mesh.get(MODEL, 1)),
    }
    if expert != {g: a for g, a in out.get("ilp", {}).items() if a is not None}:
        out["megatron_dp"] = expert
    return out


def _stage_optimum(terms: MeshTerms, work: Work | None) -> Solution:
    """The stage mesh's time optimum by its MILP, in counted work: its tables and root node
    cost its columns (at `COLUMNS_PER_SECOND`), each further node as much, and HiGHS gets
    the nodes the budget has left, so the same budget gives the same intra-stage plan on
    any machine (as `_leanest.py` counts its MILPs). HiGHS's wall-time limit is the safety
    stop only. Every zoo model's stage MILPs solve at the root, in tens of milliseconds."""
    problem = terms.problem(0, np.inf)
    if work is None:
        return solve_ilp(problem, time_limit_s=60.0)
    per_node = max(terms.columns * OPS_PER_SECOND / COLUMNS_PER_SECOND, 1.0)
    work.add(per_node)
    left = work.limit - work.done
    nodes = 1 + max(int(left // per_node), 0) if np.isfinite(left) else None  # inf: no cap
    limit = max(work.wall_left(), 0.01)
    solution = solve_ilp(problem, time_limit_s=limit, max_nodes=nodes)
    work.add(per_node * max(solution.explored - 1, 0))
    return solution


def _solve_point(
    model,
    grids,
    point: Point,
    assignment,
    schedules: Sequence[PipelineSchedule],
    savers: Sequence[tuple[int, bool]] = MEMORY_SAVERS,
    work: Work | None = None,
    until: float | None = None,
) -> tuple[Plan | None, bool]:
    """Cuts for one outer point by the exact DP for each of `schedules` (1F1B and ZB-H1 in
    a 1F1B search), each priced by the pipeline model, the fastest that fits kept; memory
    savers (ZeRO, remat) only when the plain point has no partition that fits (remat not
    under a split backward, `check_remat`), of `savers` (those whose stored state may
    fit: `fitting_savers`), none begun once `work` has done `until`. `grids`: (finest
    partition, cut candidates) without and with remat. With whether the savers were cut
    short so."""
    found = None
    for k, (zero, remat) in enumerate(savers):
        if zero and point.stage_mesh.get(DATA, 1) == 1:
            continue
        if k and until is not None and work is not None and work.done >= until:
            return found, True
        fine, cands = grids[remat]
        if work is not None:  # op_costs
            work.add(len(model.graph.ops))
        oc = op_costs(model, assignment, point.stage_mesh, zero_stage=zero, remat=remat)
        for schedule in schedules:
            if remat and schedule.splits_backward:
                continue
            if work is not None:  # the segment tables, and the plan's pricing
                work.add(2 * len(model.graph.ops))
            plan = priced_cuts(model, fine, cands, oc, point, assignment, schedule, work)
            if plan is None and not schedule.splits_backward:
                # No partition fits 1F1B: none fits a split backward either, whose W's
                # hold their residuals longer at 1F1B's in-flight count.
                break
            if plan is not None and (
                found is None or plan.predicted.step_time_s < found.predicted.step_time_s
            ):
                found = plan
        if found is not None and (zero, remat) == (0, False):
            return found, False  # the savers only add time
    return found, False


def priced_cuts(
    model, fine, cands, oc, point: Point, assignment, schedule, work: Work | None = None
) -> Plan | None:
    """The DP's cuts for `schedule` as a Plan priced by the whole pipeline model (`oc`'s
    ZeRO stage and recomputation), None where no partition fits. The DP's tables leave
    out a stage's temporaries and what runs once per step (`_cut_tables.py`): where the
    whole model puts its partition over the limit, it cuts again under the limit less the
    most the tables left out of one of its stages, `REFITS` times at most."""
    tables = segment_tables(model, fine, oc, point.microbatches, schedule, point.stages)
    limit = model.cluster.memory_limit
    for _ in range(1 + REFITS):
        cuts = optimal_cuts(model, fine, cands, oc, point, schedule, limit, tables)
        if cuts is None:
            return None
        plan = pipeline_plan(
            model.graph,
            model.groups,
            cuts,
            point.stage_mesh,
            assignment,
            point.microbatches,
            schedule.name,
            name=f"dp ({point.intra}, {point.stages} stages)",
            zero_stage=oc.zero_stage,
        )
        plan = dataclasses.replace(plan, remat=oc.remat)
        pc = estimate_pipeline(model, plan)
        if pc.cost.feasible:
            decisions = {**plan.decisions, **pipeline_decisions(pc), "intra": point.intra}
            return dataclasses.replace(plan, predicted=pc.cost, decisions=decisions)
        if work is not None:  # the refit's price
            work.add(len(model.graph.ops))
        left_out = max(_left_out(tables, cands, cuts, pc.stage_memory_bytes), 0.0)
        limit = min(limit, model.cluster.memory_limit - left_out)
    return None


def _left_out(tables, cands, cuts, priced: Sequence[float]) -> float:
    """The most memory the DP's tables leave out of one stage of the partition at `cuts`
    (the whole model's price of that stage less its tables' sum): on a 4-layer GPT under
    recomputation, its temporaries, 0.4 to 0.7 GB a stage."""
    first = [0, *(cands.index(c) + 1 for c in cuts)]
    last = [*(i - 1 for i in first[1:]), len(tables.state) - 1]
    held = tables.stage_memory(len(first))
    return max(
        float(p) - float(held[s, i, j])
        for s, (i, j, p) in enumerate(zip(first, last, priced, strict=True))
    )


def polish_cuts(model, plan: Plan, cands: tuple[int, ...], work: Work | None = None) -> Plan:
    """Hill-climb on the cuts: move one cut to the next candidate either way while the
    whole pipeline model says the step gets faster (the intra-stage plan fixed), until no
    move helps or `work` is spent (counted, not timed: the same cuts on any machine). The
    plan's recomputation, sequence parallelism and chunks per device group are kept; under
    full recomputation `cands` should be the cuts between layers (as the DP's grid)."""
    stage_mesh = {k: v for k, v in plan.mesh.items() if k != PIPE}
    # The base model's `remat=True` prices every layer recomputed in full; any other
    # policy (selective, projections) recomputes less, priced on the cost model's variant
    # for it (`CostModel.for_plan`), the same for any cuts that keep its units whole. A full
    # one on the base model, its cuts between layers.
    partial = plan.remat and plan.remat_policy != "full"
    priced_on = model.for_plan(plan) if partial else model
    oc = plan_op_costs(priced_on, plan)
    schedule = pipeline_schedule(plan.schedule, plan.virtual_stages)
    index = {c: k for k, c in enumerate(cands)}
    cuts = [index[c] for c in plan.decisions["cuts"]]
    best_time, best_pc = plan.predicted.step_time_s, None
    improved = True
    while improved and not (work and work.spent()):
        improved = False
        for k in range(len(cuts)):
            for step in (-1, 1):
                trial = [*cuts[:k], cuts[k] + step, *cuts[k + 1 :]]
                lo = trial[k - 1] if k else -1
                hi = trial[k + 1] if k + 1 < len(trial) else len(cands)
                if not lo < trial[k] < hi:
                    continue
                bounds = list(
                    zip(
                        (0, *(cands[i] for i in trial)),
                        (*(cands[i] for i in trial), len(model.graph.ops)),
                        strict=True,
                    )
                )
                if work is not None:  # a partition and its stage costs
                    work.add(2 * len(model.graph.ops))
                part = partition(model.graph, model.groups, bounds, plan.microbatches)
                pc = stage_costs(priced_on, part, oc, plan.microbatches, schedule)
                if pc.cost.feasible and pc.cost.step_time_s < best_time * (1 - 1e-9):
                    cuts, best_time, best_pc, improved = trial, pc.cost.step_time_s, pc, True
    if best_pc is None:
        return plan
    new = pipeline_plan(
        model.graph,
        model.groups,
        tuple(cands[i] for i in cuts),
        stage_mesh,
        model.plan_assignment(plan),
        plan.microbatches,
        plan.schedule,
        name=plan.name,
        zero_stage=plan.zero_stage,
        virtual_stages=plan.virtual_stages,
    )
    if plan.sequence_parallel:
        new = sequence_parallel(model.graph, model.groups, new, plan.sequence_parallel)
    return dataclasses.replace(
        new,
        remat=plan.remat,
        remat_policy=plan.remat_policy,
        remat_layers=plan.remat_layers,
        predicted=best_pc.cost,
        decisions={**plan.decisions, **new.decisions, **pipeline_decisions(best_pc)},
    )


def _finish(stats: dict[str, Any], start: float, best_time: float) -> dict[str, Any]:
    stats["search_time_s"] = round(_time.perf_counter() - start, 3)
    stats["best_time"] = float(best_time) if np.isfinite(best_time) else None
    return stats
