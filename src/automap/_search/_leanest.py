"""The feasibility proof: whether some plan of a shard space fits in memory at all, by
each mesh's leanest point (`search_leanest`), one MILP with memory as its objective.

Run before a search on a fraction of its budget (`_registry.PROOF_SHARE`), so that "no
plan fits" is a proof, not a search that ran out of time. The work is counted in the
ILP's joint options (`COLUMNS_PER_SECOND`), not timed.
"""

from __future__ import annotations

import dataclasses
import logging
import time as _time

import numpy as np

from .._solvers import leanest_problem, solve_ilp
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


@dataclasses.dataclass(frozen=True)
class Leanest:
    """What `search_leanest` found: whether some plan of a space fits in memory."""

    point: tuple[int, tuple[int, ...], int] | None
    """The leanest point of the meshes it covered: the first that fits, else the leanest of
    all (None when it covered none)."""
    memory_bytes: float
    """That point's memory per device, as the cost model prices it (inf when none)."""
    fits: bool
    """That point fits in memory: a plan of the space does, so a larger budget may help."""
    complete: bool
    """Every mesh was covered to the end (none skipped, cut short or left after a fit): when
    nothing fits, no plan of the space does (proved)."""
    work: float
    """The work done, in joint options (`COLUMNS_PER_SECOND` per second of budget)."""

    @property
    def proved(self) -> bool:
        """It has an answer: some plan fits, or none does."""
        return self.fits or self.complete


def search_leanest(space: ShardSpace, budget_s: float, wall_s: float | None = None) -> Leanest:
    """Whether some point of the space fits in memory: each mesh's leanest point, by one
    MILP with memory as its objective (`leanest_problem`), until one fits.

    Memory at a point never grows with the ZeRO stage (a stage shards state, it adds none:
    `_cost/_model.py`), so a mesh's leanest point has its highest stage, or stage 0 where
    ZeRO ties the batch to data (`ShardSpace.zero_options`) and the batch elsewhere
    splits more: two MILPs a mesh, which HiGHS solves at the root on every zoo model.
    The work is counted, not timed, so the same budget gives the same answer on a fast or
    a slow machine: a mesh costs its joint options (its tables), and each MILP
    `MILP_SETUP` plus its columns per node; `budget_s` affords `COLUMNS_PER_SECOND` a second. A mesh starts while work is left and
    its MILP gets the nodes left (the root at least), so the search ends within its budget
    plus one mesh. `wall_s` (default SAFETY x budget_s) is a safety stop only."""
    limit = budget_s * COLUMNS_PER_SECOND
    wall_s = SAFETY * budget_s if wall_s is None else wall_s
    start = _time.perf_counter()
    work, complete = 0.0, True
    best, best_cost = None, None
    for mesh_index, mesh in enumerate(space.meshes):
        wall_left = wall_s - (_time.perf_counter() - start)
        if work >= limit or wall_left <= 0:
            complete = False
            break
        try:
            cap = min(max(limit - work, MIN_COLUMNS), MAX_COLUMNS)
            terms = MeshTerms(space, mesh_index, max_columns=cap)
        except TooLarge as e:
            _log.info("leanest: mesh %s skipped, %s", mesh, e)
            complete = False
            continue
        work += terms.columns
        # The highest stage (ZeRO with the batch on data) and, where that ties the batch
        # to data, stage 0 (the batch anywhere): the leaner is the mesh's leanest point.
        top = max(space.zero_options(mesh))
        for zero in [top, 0] if top and space.batch_unit is not None else [top]:
            problem = leanest_problem(terms.problem(zero, np.inf))
            columns = problem_size(problem)[1]
            work += MILP_SETUP
            nodes = max(int((limit - work) // max(columns, 1)), 1)
            solution = solve_ilp(problem, time_limit_s=max(wall_left, 0.01), max_nodes=nodes)
            work += columns * max(solution.explored, 1)
            if not solution.feasible:
                # No point on this mesh at all is a proof too; a cut-short solve is not.
                complete &= solution.status == "infeasible"
                continue
            point = (mesh_index, tuple(solution.choices[: terms.n_units]), zero)
            cost = space.evaluate(*point[:2], zero_stage=zero)
            if best_cost is None or cost.memory_bytes < best_cost.memory_bytes:
                best, best_cost = point, cost
            if cost.feasible:
                last = mesh_index == len(space.meshes) - 1
                return Leanest(point, cost.memory_bytes, True, complete and last, work)
            # Over the limit: a proof for this mesh only when no point of it is leaner.
            complete &= solution.optimal
    memory = np.inf if best_cost is None else best_cost.memory_bytes
    return Leanest(best, memory, False, complete, work)
