"""searcher="ilp": the exact optimum of the shard space, one MILP per mesh and ZeRO stage.

The MILPs are `MeshTerms.problem`'s (`_mesh_terms.py`: how the cost model's step time and
memory become factors, and where they are exact), solved by HiGHS (`_solvers.solve_ilp`).
ZeRO-1 is skipped: ZeRO-2 has the same time for every point and never more memory. Every
ILP's point is priced again by `ShardSpace.evaluate` and the fastest feasible one wins, so
the answer is the cost model's own figure even where a factor sum differs in the last bits.
"""

from __future__ import annotations

import dataclasses
import logging
import time as _time
from typing import Any

import numpy as np

from .._solvers import solve_ilp
from .._space import ShardSpace
from ._classic import SAFETY
from ._mesh_terms import (
    COLUMNS_PER_SECOND,
    MAX_COLUMNS,
    MILP_SETUP,
    MIN_COLUMNS,
    MeshTerms,
    TooLarge,
    problem_size,
)

_log = logging.getLogger("automap")

#: The most MILPs one mesh takes: stages 0 and 2 without a memory limit, then 0, 2, 3.
SOLVES_PER_MESH = 5


def fine_space(space: ShardSpace) -> ShardSpace:
    """The same space with one decision per linkage group instead of per layer class: the
    finer space the exhaustive searcher cannot reach and the ILP still solves exactly."""
    pruning = dataclasses.replace(space.pruning, layer_grouping=False)
    return ShardSpace(
        space.graph, space.groups, space.cluster, space.cost_model, pruning, space.task
    )


def search_ilp(
    space: ShardSpace, time_limit_s: float = 60.0, on_solve=None
) -> tuple[tuple[int, tuple[int, ...], int] | None, dict[str, Any]]:
    """The best point of the space (mesh index, options, ZeRO stage) and the search stats.

    Per mesh, first stages 0 and 2 with no memory limit: ZeRO moves data parallel's
    bytes and runs the update (and a gradient the data axis does not already split) on
    shards, and stage 3 only adds gathers to stage 2, so the faster of the two bounds
    every stage of the mesh from below. A mesh whose bound is no better than the best
    plan so far is skipped; one whose fastest unlimited optimum fits in memory is solved
    by it; otherwise stages 0, 2 and 3 are solved under the limit (stage 1: module doc).

    `time_limit_s` is the whole search's budget, counted in work as `_leanest.py` counts
    it (`COLUMNS_PER_SECOND` joint options a second): a mesh costs its columns, each MILP
    `MILP_SETUP` plus its columns per branch-and-bound node, and HiGHS gets the nodes left.
    So the same budget gives the same plan on a fast or a slow machine; SAFETY x the budget
    of wall time is a safety stop only. A mesh too large for its share of the budget is
    skipped, and the search stops when the work is spent. Then `stats["cut_short"]` is
    True and the best point is the best found, not a proven optimum (None when none was:
    the caller falls back). `on_solve(point, cost, best time)` follows each MILP."""
    run = _Run(space, time_limit_s, on_solve)
    # The columns a mesh may have: its nominal share of the budget (not of the time left,
    # which depends on the machine), at COLUMNS_PER_SECOND.
    share = time_limit_s / (SOLVES_PER_MESH * max(len(space.meshes), 1))
    try:
        for mesh_index, mesh in enumerate(space.meshes):
            run.mesh(mesh_index)
            if run.spent():
                run.cut_short = True
                break
            try:
                cap = min(max(COLUMNS_PER_SECOND * share, MIN_COLUMNS), MAX_COLUMNS)
                terms = MeshTerms(space, mesh_index, max_columns=cap)
            except TooLarge as e:
                _log.info("ilp: mesh %s skipped, %s", mesh, e)
                run.skipped.append(dict(mesh))
                run.optimal, run.cut_short = False, True
                continue
            run.tables(terms)
            # Without a memory limit, stage 0 and stage 2 (ZeRO's compute on shards but
            # none of stage 3's second gathers): the faster bounds every stage.
            stages = [z for z in space.zero_options(mesh) if z != 1]
            bounds = [run.solve(terms, z, np.inf) for z in stages if z in (0, 2)]
            times = [c.step_time_s if c is not None else np.inf for _, c in bounds]
            solution, bound = bounds[int(np.argmin(times))]
            if all(s.optimal for s, _ in bounds) and min(times) >= run.best_time:
                continue  # nothing on this mesh, or nothing better than the best so far
            if solution.optimal and bound is not None and bound.feasible:
                continue  # the fastest unlimited optimum fits: no stage does better
            for zero in stages:
                run.solve(terms, zero, space.cluster.memory_limit)
    except KeyboardInterrupt:
        # Ctrl-C keeps the best point so far (no longer a proof of optimality).
        if run.best is None:
            raise
        return run.best, {**run.stats(), "optimal": False, "interrupted": True}
    return run.best, run.stats()


class _Run:
    """The MILPs of one search: the best point so far and the figures for the stats."""

    def __init__(self, space: ShardSpace, time_limit_s: float, on_solve):
        self.space, self.on_solve = space, on_solve
        self.limit, self.work = time_limit_s * COLUMNS_PER_SECOND, 0.0
        self.wall_s = SAFETY * time_limit_s
        self.start = _time.perf_counter()
        self.best, self.best_time, self.time_to_best = None, np.inf, 0.0
        self.curve, self.gaps, self.errors, self.sizes = [], [0.0], [0.0], [(0, 0)]
        self.optimal, self.solve_time = True, 0.0
        self.cut_short, self.skipped = False, []
        self.mesh_index, self.mesh_solves = 0, 0

    def mesh(self, mesh_index: int) -> None:
        self.mesh_index, self.mesh_solves = mesh_index, 0

    def wall_left(self) -> float:
        return self.wall_s - (_time.perf_counter() - self.start)

    def spent(self) -> bool:
        """The budget's work is done, or the wall-clock safety stop is reached."""
        return self.work >= self.limit or self.wall_left() <= 0

    def tables(self, terms: MeshTerms) -> None:
        """A mesh's tables cost its joint options."""
        self.work += terms.columns

    def nodes(self, columns: int) -> int | None:
        """The branch-and-bound nodes a MILP of `columns` gets: what the work left pays
        for, the root at least (so a spent budget still ends on a point, then stops);
        None (no cap) on an unlimited budget."""
        self.work += MILP_SETUP
        if not np.isfinite(self.limit):
            return None
        return max(int((self.limit - self.work) // max(columns, 1)), 1)

    def solve(self, terms: MeshTerms, zero: int, limit: float):
        """Solve one MILP; returns its solution and the cost model's cost of its point (None
        when it has none). Only points the cost model calls feasible become the best."""
        space, cost = self.space, None
        self.mesh_solves += 1
        for _ in range(3):
            problem = terms.problem(zero, limit)
            size = problem_size(problem)
            self.sizes.append(size)
            nodes = self.nodes(size[1])
            # HiGHS wants a positive time limit: the safety stop, never the budget.
            solution = solve_ilp(problem, time_limit_s=max(self.wall_left(), 0.01), max_nodes=nodes)
            self.work += size[1] * max(solution.explored, 1)
            self.solve_time += solution.solve_time_s
            if not solution.feasible:
                cost = None
                break
            point = (terms.mesh_index, tuple(solution.choices[: terms.n_units]), zero)
            cost = space.evaluate(*point[:2], zero_stage=zero)
            if cost.feasible or not np.isfinite(limit):
                break
            # Over the limit by a rounding of the factor sums: ask again a hair below.
            limit *= 1.0 - 1e-9
        if solution.status not in ("optimal", "infeasible"):
            self.cut_short = True  # the node cap (the budget) or the safety stop ended it
        if cost is None:
            # Proven infeasible is still a proof; a time-out without a plan is not.
            self.optimal &= solution.status == "infeasible"
            solution = dataclasses.replace(solution, optimal=solution.status == "infeasible")
        else:
            self.optimal &= solution.optimal
            self.gaps.append(solution.gap)
            # A plan priced at no time (a step of free ops) has no relative error to speak of.
            scale = cost.step_time_s or 1.0
            self.errors.append(abs(solution.time - cost.step_time_s) / scale)
            if cost.feasible and cost.step_time_s < self.best_time:
                self.best, self.best_time = point, cost.step_time_s
                self.time_to_best = _time.perf_counter() - self.start
        if self.on_solve is not None:  # after every MILP, infeasible ones too (cost None)
            self.on_solve(point if cost is not None else None, cost, self.best_time)
        current = cost.step_time_s if cost is not None else np.inf
        self.curve.append(
            {"episode": len(self.curve) + 1, "best_time": self.best_time, "current_time": current}
        )
        return solution, cost

    def stats(self) -> dict[str, Any]:
        optimal = self.optimal
        if max(self.errors) > 1e-6:
            # The factors no longer mirror the cost model (it changed under them): the plan
            # is still priced by the cost model, but no longer proven the optimum.
            _log.warning("ILP objective differs from the cost model by %.2g", max(self.errors))
            optimal = False
        return {
            "evaluated": len(self.curve),
            "time_to_best_s": round(self.time_to_best, 3),
            "optimal": bool(optimal),
            "gap": float(max(self.gaps)),
            "solve_time_s": round(self.solve_time, 3),
            "factors": max(f for f, _ in self.sizes),
            "variables": max(v for _, v in self.sizes),
            "objective_error": float(max(self.errors)),
            "work": self.work,  # in joint options (`COLUMNS_PER_SECOND` a second)
            "curve": self.curve,
            # The budget ended the search before its proof: a mesh too large for its share
            # was skipped, a MILP hit its time limit, or the time ran out.
            **({"cut_short": True, "skipped_meshes": self.skipped} if self.cut_short else {}),
        }
