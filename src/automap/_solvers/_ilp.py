"""Exact MILP over a factored plan space (Alpa-style intra-operator formulation), via HiGHS.

Variables:
    x[u, o] binary, one per unit u and allowed option o; sum_o x[u, o] = 1.
    y[f, c] in [0, 1], one per factor block f (factors merged on their unit set, arity >= 2)
        and joint configuration c of its units whose options are allowed and whose time and
        memory entries are all finite.
Constraints:
    marginals: for every unit u of block f and allowed option o,
        sum_{c : c_u = o} y[f, c] = x[u, o].
        With x one-hot these force y to the single configuration x picks (so y needs no
        integrality: fewer integer columns, same optimum), and make y <= x and sum_c y = 1
        implied; an excluded (forbidden) configuration makes the matching x combination
        infeasible.
    memory, for each time point p: sum of memory entries times x (arity 1) or y (arity >= 2)
        <= memory_limit minus the point's constant memory; rows scaled by 1 / memory_limit so
        HiGHS's absolute feasibility tolerance becomes a relative one on bytes.
Objective: sum of time entries times x or y, plus constant_time; divided by the largest
    coefficient so that HiGHS's absolute gap tolerance means the same on any time scale.
    With `minimize="peak"` one more column z, the peak memory, joins the objective and
    every memory row (sum - z <= -constant: z bounds each point; z <= the limit, if any).
    Each `Overlap` adds a continuous column h >= 0 at cost -1 and two rows, h <= its comm
    sum and h <= its compute sum (entries times x or y): minimizing, h rises to the
    smaller, so the objective takes min(comm, compute) off exactly.

The model is exact for the factor model: every assignment's cost is the sum of its factor
entries, and the ILP's feasible integral points are exactly the feasible assignments.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time as _time

import highspy
import numpy as np

from ._factor import MEMORY_RTOL, FactorProblem, Solution, evaluate, merge_factors

_INF = highspy.kHighsInf


def _new_highs() -> highspy.Highs:
    """A HiGHS instance with logging off.

    HiGHS prints its banner from C on the first construction in a process, before any option
    can be set; pointing file descriptor 1 at /dev/null for that moment keeps CLI output
    (and JSON written to stdout) clean.
    """
    sys.stdout.flush()
    with contextlib.ExitStack() as stack:
        try:
            saved = os.dup(1)
            devnull = os.open(os.devnull, os.O_WRONLY)
        except OSError:  # no real stdout (embedded interpreters): nothing to hide
            saved = None
        if saved is not None:
            os.dup2(devnull, 1)
            os.close(devnull)
            stack.callback(os.close, saved)
            stack.callback(os.dup2, saved, 1)
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    return highs


class _Columns:
    """Column store: cost, bounds, integrality, and COO entries grouped later into CSC."""

    def __init__(self) -> None:
        self.n = 0
        self.cost: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []

    def add(self, cost: np.ndarray, upper: np.ndarray, integer: bool) -> np.ndarray:
        ids = np.arange(self.n, self.n + cost.size)
        self.n += cost.size
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(np.full(cost.size, integer))
        return ids


class _Milp:
    """The MILP's arrays as they are built: columns (`_Columns`), constraint rows as COO
    entries with their bounds, and the memory rows (one per point, in units of `ref`)."""

    def __init__(self, problem: FactorProblem, tables: _Tables):
        self.problem, self.tables = problem, tables
        self.cols = _Columns()
        self.rows: list[np.ndarray] = []
        self.entry_cols: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.n_rows = 0
        self.x_col: list[np.ndarray] = []  # per unit: option -> column id, -1 where masked
        self.y_cols: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # configs, ids
        # Memory rows in units of `ref` bytes: the limit, or for a peak objective without
        # one the largest entry, so that HiGHS's absolute tolerances mean the same on any
        # size.
        self.ref = tables.limit if tables.has_limit else 1.0
        if tables.peak and not tables.has_limit:
            self.ref = tables.largest_memory()
        self.rows_on = tables.has_limit or tables.peak
        self.memory_row = self.add_rows(tables.n_points, -_INF, 1.0) if self.rows_on else -1
        if self.rows_on:
            # A peak objective z (in ref bytes) bounds every point: sum - z <= -constant.
            const = tables.constant_memory
            self.upper[-1] = -const / self.ref if tables.peak else 1.0 - const / tables.limit

    def add_rows(self, count: int, lo: float, hi: float) -> int:
        self.lower.append(np.full(count, lo))
        self.upper.append(np.full(count, hi))
        self.n_rows += count
        return self.n_rows - count

    def add_entries(self, r, c, v) -> None:
        self.rows.append(np.asarray(r, dtype=np.int64))
        self.entry_cols.append(np.asarray(c, dtype=np.int64))
        self.values.append(np.asarray(v, dtype=np.float64))

    def add_memory(self, col_ids, memory) -> None:
        if not self.rows_on:
            return
        for p, table in enumerate(memory):
            nz = table != 0.0
            self.add_entries(
                np.full(nz.sum(), self.memory_row + p), col_ids[nz], table[nz] / self.ref
            )

    def add_x(self, u: int, mask: np.ndarray) -> bool:
        """One binary per allowed option of unit u; its single-unit factors cost straight
        on them. False when no option is allowed (the problem is infeasible)."""
        opts = np.flatnonzero(mask)
        if opts.size == 0:
            return False
        tables = self.tables
        time, memory = tables.of((u,)) if (u,) in tables.keys else (np.zeros(mask.size), [])
        finite = np.isfinite(time[opts]) & np.all(
            [np.isfinite(m[opts]) for m in memory] or [np.ones(opts.size, bool)], axis=0
        )
        cost = np.where(finite, time[opts], 0.0)
        ids = self.cols.add(cost, finite.astype(np.float64), integer=True)
        mapping = np.full(mask.size, -1, dtype=np.int64)
        mapping[opts] = ids
        self.x_col.append(mapping)
        r = self.add_rows(1, 1.0, 1.0)
        self.add_entries(np.full(ids.size, r), ids, np.ones(ids.size))
        self.add_memory(ids, [np.where(finite, m[opts], 0.0) for m in memory])
        return True

    def add_y(self, units: tuple[int, ...]) -> bool:
        """One block of y for a unit set of arity >= 2, tied to the x by marginal rows.
        False when no joint option is valid (the problem is infeasible)."""
        allowed = self.problem.allowed
        time, memory = self.tables.of(units)
        valid = np.isfinite(time)
        for m in memory:
            valid &= np.isfinite(m)
        for axis, u in enumerate(units):
            shape = [1] * len(units)
            shape[axis] = -1
            valid &= allowed[u].reshape(shape)
        configs = np.argwhere(valid)  # (c, arity) option ids, row-major order
        if configs.size == 0:
            return False
        index = tuple(configs.T)
        ids = self.cols.add(time[index], np.ones(len(configs)), integer=False)
        self.y_cols[units] = (configs, ids)
        for axis, u in enumerate(units):
            # One marginal row per allowed option of u: sum of y with c_u = o, minus x[u, o].
            opts = np.flatnonzero(allowed[u])
            local = np.full(allowed[u].size, -1, dtype=np.int64)
            local[opts] = np.arange(opts.size)
            base = self.add_rows(opts.size, 0.0, 0.0)
            self.add_entries(base + local[configs[:, axis]], ids, np.ones(ids.size))
            self.add_entries(base + np.arange(opts.size), self.x_col[u][opts], -np.ones(opts.size))
        self.add_memory(ids, [m[index] for m in memory])
        return True

    def add_overlaps(self) -> None:
        """Per overlap, h >= 0 at cost -1, bounded by each of its two sums."""
        for sides in self.tables.overlaps:
            (h,) = self.cols.add(np.array([-1.0]), np.array([_INF]), integer=False)
            for side in sides:
                const = float(side.get((), 0.0))
                r = self.add_rows(1, -_INF, const)
                self.add_entries([r], [h], [1.0])
                for units, table in side.items():
                    if units:
                        cols, values = self._entries(units, table)
                        self.add_entries(np.full(cols.size, r), cols, -values)

    def _entries(self, units: tuple[int, ...], table: np.ndarray):
        """(columns, table values) of a unit set's x (one unit) or y (several)."""
        if len(units) == 1:
            mapping = self.x_col[units[0]]
            opts = np.flatnonzero(mapping >= 0)
            return mapping[opts], table[opts]
        configs, ids = self.y_cols[units]
        return ids, table[tuple(configs.T)]

    def add_peak(self) -> None:
        """The peak objective's column z, in every memory row."""
        n_points, has_limit = self.tables.n_points, self.tables.has_limit
        z = self.cols.add(np.array([self.ref]), np.array([1.0 if has_limit else _INF]), False)
        rows = self.memory_row + np.arange(n_points)
        self.add_entries(rows, np.repeat(z, n_points), -np.ones(n_points))

    def arrays(self) -> dict:
        cols, rows = self.cols, self.rows
        return {
            "cost": np.concatenate(cols.cost) if cols.n else np.zeros(0),
            "upper": np.concatenate(cols.upper) if cols.n else np.zeros(0),
            "integer": np.concatenate(cols.integer) if cols.n else np.zeros(0, bool),
            "rows": np.concatenate(rows) if rows else np.zeros(0, np.int64),
            "cols": np.concatenate(self.entry_cols) if rows else np.zeros(0, np.int64),
            "values": np.concatenate(self.values) if rows else np.zeros(0),
            "row_lower": np.concatenate(self.lower) if self.lower else np.zeros(0),
            "row_upper": np.concatenate(self.upper) if self.upper else np.zeros(0),
            "constant_time": self.tables.constant_time,
            "x_col": self.x_col,
        }


class _Tables:
    """A problem's factors merged on their unit sets across time and memory (so one y
    block carries both), and its constants."""

    def __init__(self, problem: FactorProblem):
        self.limit = float(problem.memory_limit)
        self.has_limit = bool(np.isfinite(self.limit) and problem.memory_factors)
        self.peak = problem.minimize == "peak" and bool(problem.memory_factors)
        self.n_points = len(problem.memory_factors)
        self.n_options = problem.n_options
        self.time = merge_factors(problem.time_factors)
        self.memory = [merge_factors(point) for point in problem.memory_factors]
        # Per overlap, its comm and its compute factors merged on their unit sets: each
        # set gets its x or y columns even where no time or memory factor has it.
        self.overlaps = [
            (merge_factors(o.comm), merge_factors(o.compute)) for o in problem.overlaps
        ]
        self.keys = set(self.time).union(*self.memory, *(k for o in self.overlaps for k in o))
        self.constant_time = float(problem.constant_time) + float(self.time.pop((), 0.0))
        # (points,)
        self.constant_memory = np.array([float(m.pop((), 0.0)) for m in self.memory])
        self.keys.discard(())

    def infeasible(self) -> bool:
        """Trivially: an infinite constant, or a constant memory over the limit."""
        if not np.isfinite(self.constant_time) or not np.all(np.isfinite(self.constant_memory)):
            return True
        over = self.constant_memory > self.limit * (1.0 + MEMORY_RTOL)
        return self.has_limit and bool(np.any(over))

    def of(self, units):
        shape = tuple(self.n_options[u] for u in units)
        time = self.time.get(units, np.zeros(shape))
        memory = [m.get(units, np.zeros(shape)) for m in self.memory]
        return time, memory

    def largest_memory(self) -> float:
        entries = [
            np.abs(t[np.isfinite(t)]).max(initial=0.0) for m in self.memory for t in m.values()
        ]
        return max(1.0, float(np.abs(self.constant_memory).max(initial=0.0)), *entries)


def _build(problem: FactorProblem):
    """Arrays of the MILP, or None when the problem is trivially infeasible."""
    tables = _Tables(problem)
    if tables.infeasible():
        return None
    milp = _Milp(problem, tables)
    # x: one binary per allowed option; single-unit factors cost straight on x.
    if not all(milp.add_x(u, mask) for u, mask in enumerate(problem.allowed)):
        return None
    # y: one block per unit set of arity >= 2.
    if not all(milp.add_y(units) for units in sorted(k for k in tables.keys if len(k) >= 2)):
        return None
    if tables.peak:
        milp.add_peak()
    milp.add_overlaps()
    return milp.arrays()


def _lp(model) -> highspy.HighsLp:
    """Column-wise HighsLp from the COO entries, objective scaled to unit magnitude."""
    n_cols = model["cost"].size
    order = np.lexsort((model["rows"], model["cols"]))
    cols = model["cols"][order]
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = model["row_lower"].size
    scale = float(np.max(np.abs(model["cost"]), initial=0.0)) or 1.0
    lp.col_cost_ = model["cost"] / scale
    lp.col_lower_ = np.zeros(n_cols)
    lp.col_upper_ = model["upper"]
    lp.row_lower_ = model["row_lower"]
    lp.row_upper_ = model["row_upper"]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(cols, np.arange(n_cols + 1)).astype(np.int32)
    lp.a_matrix_.index_ = model["rows"][order].astype(np.int32)
    lp.a_matrix_.value_ = model["values"][order]
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
        for i in model["integer"]
    ]
    return lp


def solve_ilp(
    problem: FactorProblem,
    *,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 0.0,
    max_nodes: int | None = None,
) -> Solution:
    """Solve the factored plan space exactly with HiGHS (see the module docstring).

    `time`, `memory` and `feasible` of the result come from `evaluate` on the chosen options,
    not from the solver's objective, so they are exactly comparable with other searchers.
    `optimal` is True only when HiGHS proves optimality (to `mip_rel_gap`) and the plan
    checks feasible; on a time limit the best plan found is returned with its gap.
    `max_nodes` caps the branch-and-bound nodes (the root is one): a limit in work, which
    ends the solve at the same point on any machine, where `time_limit_s` does not.
    """
    start = _time.perf_counter()
    model = _build(problem)

    def infeasible(status: str, explored: int = 0) -> Solution:
        return Solution.infeasible(_time.perf_counter() - start, explored, status)

    if model is None:
        return infeasible("infeasible")
    if model["cost"].size == 0:  # no units: the one empty assignment, nothing to solve
        time, memory, feasible = evaluate(problem, ())
        if not feasible:
            return infeasible("infeasible")
        return Solution(
            (), time, memory, True, True, 0.0, _time.perf_counter() - start, 0, "optimal"
        )
    highs = _new_highs()
    # A fixed seed: the same problem gives the same plan every run. The thread count is left
    # alone: HiGHS's scheduler is process-wide, and asking for another count than an earlier
    # user of highspy in this process makes every later solve fail.
    highs.setOptionValue("random_seed", 0)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    if max_nodes is not None:
        highs.setOptionValue("mip_max_nodes", max(int(max_nodes), 1))
    highs.setOptionValue("mip_abs_gap", 1e-9)  # the objective is scaled to O(1)
    highs.setOptionValue("mip_feasibility_tolerance", 1e-9)
    highs.setOptionValue("primal_feasibility_tolerance", 1e-9)
    if highs.passModel(_lp(model)) == highspy.HighsStatus.kError:
        raise RuntimeError("HiGHS refused the model built for this FactorProblem")
    if highs.run() == highspy.HighsStatus.kError:
        # An error is not a proof of infeasibility: never report it as one.
        raise RuntimeError(f"HiGHS failed: {highs.modelStatusToString(highs.getModelStatus())}")
    status = highs.getModelStatus()
    info = highs.getInfo()
    nodes = int(info.mip_node_count)
    has_point = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    if not has_point:
        return infeasible(highs.modelStatusToString(status).lower(), nodes)

    x = np.asarray(highs.getSolution().col_value)
    choices = tuple(
        int(np.flatnonzero(mapping >= 0)[np.argmax(x[mapping[mapping >= 0]])])
        for mapping in model["x_col"]
    )
    time, memory, feasible = evaluate(problem, choices)
    proven = status == highspy.HighsModelStatus.kOptimal
    return Solution(
        choices=choices,
        time=time,
        memory=memory,
        feasible=feasible,
        optimal=bool(proven and feasible),
        gap=float(info.mip_gap),
        solve_time_s=_time.perf_counter() - start,
        explored=nodes,
        status=highs.modelStatusToString(status).lower(),
    )
