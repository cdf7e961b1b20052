"""The `dp` searcher: hybrid data x tensor x pipeline plans, stage cuts solved exactly.

The hybrid space has two levels. The outer one is small and enumerated: the stage count
S (a divisor of the device count), the stage mesh (data x model over the remaining devices,
tensor parallel inside a node), the microbatch count, the ZeRO stage and
rematerialization. For each point the intra-stage plan is the ILP optimum of the stage mesh
(time only: memory is the pipeline's business) or the Megatron x data expert assignment,
and the inner level, where the cuts go, is the exact stage DP (`_solvers/_pipeline_dp.py`)
over the cut candidates, with per-segment tables read from the pipeline cost model. Every
partition the DP returns is priced again by the full pipeline model, which is what ranks
them. ZeRO and rematerialization only trade time for memory, so they are tried only where
the plain point has no partition that fits. A 1F1B search cuts each point for ZB-H1 too
(each backward split into B and W, the W's deferred into the drain: `dp_schedules`), the
DP's tables then timing F, B and W apart (`_cut_tables.py`), and keeps the faster.

Exact within a point in the DP's objective (per-microbatch stage time plus its sends). That
objective leaves out what happens once per step (a tied embedding sent between its stages,
the slowest stage's update), so the best few partitions are then polished against the
whole model, one cut moved at a time, and then tried with the decisions the DP does not
make (sequence parallelism, selective recomputation, interleaving, ZB-H1 on 1F1B's
cuts: `_techniques.py`). The
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
    axis_assignment,
    batch_groups,
    block_groups,
    candidate_meshes,
    microbatch_counts,
    stage_counts,
)
from ._cut_tables import optimal_cuts
from ._mesh_terms import COLUMNS_PER_SECOND, MAX_COLUMNS, MIN_COLUMNS, MeshTerms, TooLarge
from ._techniques import dp_schedules, polish_techniques
from ._work import OPS_PER_SECOND, Work

#: How many of the best points' partitions are polished against the whole model.
POLISHED = 3
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
    batch = groups.batch_size
    found: list[Plan] = []
    best: Plan | None = None
    best_time = np.inf
    try:
        for point, assignment in _points(model, cands, batch, microbatching, work, stats):
            if work.spent():
                stats["complete"] = False
                break
            stats["points"] += 1
            plan = _solve_point(model, grids, point, assignment, schedules, work=work)
            if plan is not None:
                found.append(plan)
                if plan.predicted.step_time_s < best_time:
                    best, best_time = plan, plan.predicted.step_time_s
            if on_point is not None:
                on_point(plan, best_time)
        # The DP's objective leaves out what happens once per step (a tied embedding sent
        # between its stages, the slowest stage's update): polish the best few against
        # the whole model by moving one cut at a time to a neighbouring candidate.
        for plan in sorted(found, key=lambda p: p.predicted.step_time_s)[:POLISHED]:
            if work.spent():
                break
            plan = polish_cuts(model, plan, grids[plan.remat][1], work=work)
            # Then the decisions the DP does not make: sequence parallelism, selective
            # recomputation, interleaving, ZB-H1 (`_techniques.py`).
            plan = polish_techniques(model, plan, whole, work=work)
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


def pipeline_notes(graph: Graph) -> tuple[str, ...]:
    """What limits the pipelines of this program, for the plan's provenance: layers in one
    scan, which the stage cuts (between top-level ops) cannot split."""
    stack = scanned_layers(graph)
    if stack is None:
        return ()
    return (f"pipelines can only cut around the layers: {stack.why_no_cuts()}",)


def _points(model, cands: tuple[int, ...], batch: int, microbatching: bool, work=None, stats=None):
    """The outer level, (point, intra-stage assignment) by stage count, stage mesh,
    intra-stage plan and microbatch count."""
    graph, groups, cluster = model.graph, model.groups, model.cluster
    for S in stage_counts(cluster.devices, len(cands), cluster.devices_per_node):
        per_stage = cluster.devices // S
        space = ShardSpace(graph, groups, cluster.with_devices(per_stage), model)
        for mesh_index, mesh in enumerate(candidate_meshes(per_stage)):
            if mesh.get(MODEL, 1) > cluster.devices_per_node:
                continue  # tensor parallel across nodes: never worth it
            if work is not None and work.spent():
                # Stopped before this mesh's points were made: the search loop never
                # sees them, so the stop is recorded here (a search with no plan that
                # said complete would read as a proof that nothing fits).
                if stats is not None:
                    stats["complete"] = False
                return
            for intra, assignment in _intra_plans(space, mesh_index, mesh, work, stats).items():
                for m in microbatch_counts(batch, mesh.get(DATA, 1), S, microbatching):
                    yield Point(S, mesh, m, intra), assignment


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
    work: Work | None = None,
) -> Plan | None:
    """Cuts for one outer point by the exact DP for each of `schedules` (1F1B and ZB-H1 in
    a 1F1B search), each priced by the pipeline model, the fastest that fits kept; memory
    savers (ZeRO, remat) only when the plain point has no partition that fits (remat not
    under a split backward, `check_remat`). `grids`: (finest partition, cut candidates)
    without and with remat."""
    found = None
    for zero, remat in MEMORY_SAVERS:
        if zero and point.stage_mesh.get(DATA, 1) == 1:
            continue
        fine, cands = grids[remat]
        if work is not None:  # op_costs
            work.add(len(model.graph.ops))
        oc = op_costs(model, assignment, point.stage_mesh, zero_stage=zero, remat=remat)
        for schedule in schedules:
            if remat and schedule.splits_backward:
                continue
            if work is not None:  # the segment tables, and the plan's pricing
                work.add(2 * len(model.graph.ops))
            plan = _priced_cuts(model, fine, cands, oc, point, assignment, schedule)
            if plan is not None and (
                found is None or plan.predicted.step_time_s < found.predicted.step_time_s
            ):
                found = plan
        if found is not None and (zero, remat) == (0, False):
            return found  # the savers only add time
    return found


def _priced_cuts(model, fine, cands, oc, point: Point, assignment, schedule) -> Plan | None:
    """The DP's cuts for `schedule` as a Plan priced by the whole pipeline model (`oc`'s
    ZeRO stage and recomputation), None where no partition fits."""
    cuts = optimal_cuts(model, fine, cands, oc, point, schedule)
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
    plan = dataclasses.replace(
        plan,
        predicted=pc.cost,
        decisions={**plan.decisions, **pipeline_decisions(pc), "intra": point.intra},
    )
    return plan if pc.cost.feasible else None


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
