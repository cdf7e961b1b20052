"""`automap compare`: every searcher side by side on one problem, in one run.

The program is captured once and every searcher plans it under the same cost model, so
the rows differ only in how they search. Expert rows carry each expert plan's name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from .._axes import PIPE
from .._cluster import Cluster
from .._errors import AutomapError
from .._plan import Plan
from .._report import human_bytes, human_time
from .._search import Problem, check_budget, check_seed, priced_experts, run_searcher

DEFAULT_SEARCHERS = ("expert", "exhaustive", "random", "mcmc")


@dataclasses.dataclass(frozen=True)
class Row:
    searcher: str
    plan_name: str
    step_time_s: float | None
    memory_bytes: float | None
    feasible: bool
    search_time_s: float
    mfu: float | None
    plan: Plan | None
    note: str = ""  # why a searcher gave no plan (space too large, nothing feasible...)

    @property
    def stages(self) -> int:
        """Pipeline stages of the row's plan (1: no pipeline, 0: no plan)."""
        return 0 if self.plan is None else max(1, len(self.plan.stages))

    @property
    def shape(self) -> str:
        """The plan's mesh, and for a pipeline its microbatches and schedule, in words:
        "pipe 4 × data 2 × model 4, 16 mb 1f1b". Plan names alone do not say it (an
        expert pipeline is named by its recipe, not its stage count)."""
        if self.plan is None:
            return ""
        # A one-stage plan may carry a pipe axis of 1 (a recipe with pp=1): it says nothing.
        axes = {k: v for k, v in self.plan.mesh.items() if k != PIPE or self.stages > 1}
        mesh = " × ".join(f"{k} {v}" for k, v in axes.items()) or "one device"
        if self.plan.replicated and self.plan.devices > 1:
            return f"replicated ({mesh}: nothing split)"
        if self.stages > 1:
            mesh += f", {self.plan.microbatches} mb {self.plan.schedule}"
        elif self.plan.microbatches > 1:
            mesh += f", {self.plan.microbatches} mb accumulated"
        if self.plan.zero_stage:
            mesh += f", ZeRO-{self.plan.zero_stage}"
        return mesh

    def to_dict(self) -> dict[str, Any]:
        return {
            "searcher": self.searcher,
            "plan_name": self.plan_name,
            "shape": self.shape,
            "stages": self.stages,
            "microbatches": None if self.plan is None else self.plan.microbatches,
            "step_time_s": self.step_time_s,
            "memory_bytes": self.memory_bytes,
            "feasible": self.feasible,
            "search_time_s": round(self.search_time_s, 3),
            "mfu": self.mfu,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "note": self.note,
        }


def make_row(searcher: str, plan: Plan, seconds: float) -> Row:
    cost = plan.predicted
    return Row(
        searcher=searcher,
        plan_name=plan.name,
        step_time_s=None if cost is None else cost.step_time_s,
        memory_bytes=None if cost is None else cost.memory_bytes,
        feasible=bool(cost and cost.feasible),
        search_time_s=seconds,
        mfu=None if cost is None else cost.mfu,
        plan=plan,
    )


def compare(
    step_fn: Callable,
    *args: Any,
    cluster: Cluster,
    searchers: Sequence[str] = DEFAULT_SEARCHERS,
    budget_s: float = 30.0,
    seed: int = 0,
    origin: Mapping[str, Any] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Plan `step_fn(*args)` with each searcher under the same budget and cost model."""
    check_budget(budget_s, searchers)
    check_seed(seed)
    problem = Problem.build(step_fn, args, cluster, None)
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for name in searchers:
        start = time.perf_counter()
        if name == "expert":
            try:
                experts = priced_experts(problem)
            except AutomapError as e:  # keep the other searchers' rows
                add(
                    Row(
                        name, "", None, None, False, time.perf_counter() - start, None, None, str(e)
                    )
                )
                continue
            for plan in experts.values():
                add(make_row("expert", _with_origin(plan, origin), time.perf_counter() - start))
            if not experts:
                note = f"no expert plan applies on {cluster.devices} devices"
                add(Row(name, "", None, None, False, time.perf_counter() - start, None, None, note))
            continue
        try:
            plan = run_searcher(problem, name, budget_s, seed)
        except AutomapError as e:
            add(Row(name, "", None, None, False, time.perf_counter() - start, None, None, str(e)))
            continue
        row = make_row(name, _with_origin(plan, origin), time.perf_counter() - start)
        if plan.decisions.get("complete") is False and name == "exhaustive":
            seen, size = plan.decisions.get("evaluated"), plan.decisions.get("space_points")
            row = dataclasses.replace(
                row,
                note=f"the budget ran out after {seen:,} of {size:,} points: the best so far, "
                "not a proven optimum (raise --budget)",
            )
        add(row)
    return rows


def _with_origin(plan: Plan, origin: Mapping[str, Any] | None) -> Plan:
    if not origin:
        return plan
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, **origin))


def speedups(rows: Sequence[Row]) -> dict[int, float | None]:
    """Speed-up of each row over data parallel (None where either is missing/infeasible)."""
    base = next(
        (r.step_time_s for r in rows if r.plan_name == "data_parallel" and r.feasible), None
    )
    return {
        i: (base / r.step_time_s if base and r.step_time_s and r.feasible else None)
        for i, r in enumerate(rows)
    }


def to_json(model: str, cluster: Cluster, rows: Sequence[Row]) -> dict[str, Any]:
    return {
        "model": model,
        "cluster": cluster.name,
        "devices": cluster.devices,
        "rows": [r.to_dict() for r in rows],
    }


def compare_table(what: str, cluster: Any, rows: Sequence[Any]) -> Table:
    ups = speedups(rows)
    notes: list[str] = []
    table = Table(
        title=f"{what} on {cluster.name} × {cluster.devices}: every searcher",
        caption_justify="left",
    )
    for col in (
        "searcher",
        "plan",
        "mesh / pipeline",
        "step time",
        "vs DP",
        "memory/device",
        "feasible",
        "search",
        "MFU",
    ):
        left = col in ("searcher", "plan") or col.startswith("mesh")
        table.add_column(col, justify="left" if left else "right")
    for i, r in enumerate(rows):
        if r.plan is None:
            # The reason goes under the table: a narrow column would shred it.
            table.add_row(
                r.searcher, "—", "—", "—", "—", "—", "no", f"{r.search_time_s:.1f} s", "—"
            )
            notes.append(f"{r.searcher}: {r.note}")
            continue
        table.add_row(
            r.searcher,
            escape(r.plan_name),
            r.shape,
            human_time(r.step_time_s),
            "—" if ups[i] is None else f"{ups[i]:.2f}×",
            human_bytes(r.memory_bytes),
            "yes" if r.feasible else "no",
            f"{r.search_time_s:.1f} s",
            f"{r.mfu:.1%}",
        )
    if notes:
        table.caption = escape("\n".join(notes))
    return table
