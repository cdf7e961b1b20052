"""Korthikanti et al.'s table of sequence parallelism and selective recomputation, priced
by Auto-MAP, and the planner's plans for the same models and GPUs.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv 2205.05198), Table 5: GPT with vocabulary 51,200 and sequence 2048 on
A100 80 GB (Selene), mixed precision, data parallel 1; each row's iteration time with
full recomputation (no sequence parallelism) and with sequence parallelism plus selective
recomputation, the configuration otherwise the same (tensor parallel inside the node,
pipeline stages, microbatch size, interleaved schedule with v model chunks per device).

Each row is priced twice with its published configuration (`Recipe`), once per column,
and the predicted speedup of the second over the first is set against the published one.
With a planner budget the planner runs on the row's model and GPUs in a fresh process
(`_isolated.plan_isolated`), its plan set against the published configuration with
both techniques. One source for `benchmarks/bench_korthikanti.py` and `automap bench`'s
section of BENCHMARKS.md (`_markdown.korthikanti_lines`). Abstract shapes only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._plan import Cost
from .._search import Problem
from .._space import Recipe, recipe_plan
from ._isolated import PlanJob, planner_columns, train_step
from ._megatron import MegatronRow, job_of, megatron_priced

CLUSTER = "a100"


@dataclasses.dataclass(frozen=True)
class KorthikantiRow:
    """One row of the published table: configuration and both iteration times."""

    name: str  # as published: "22B", "175B", ...
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    microbatch: int  # sequences per microbatch
    virtual: int  # interleaving: model chunks per device
    full_s: float  # published iteration time, full recomputation
    modern_s: float  # published iteration time, sequence parallel + selective

    @property
    def published_speedup(self) -> float:
        return self.full_s / self.modern_s

    def job(self) -> PlanJob:
        """The row's model (the GPT of `_megatron`'s rows) on its GPUs."""
        return job_of(
            MegatronRow(
                0.0, self.heads, self.hidden, self.layers, self.tp, self.pp, self.gpus,
                self.batch, 0.0,
            )
        )  # fmt: skip


KORTHIKANTI_TABLE = (
    KorthikantiRow("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    KorthikantiRow("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    KorthikantiRow("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    KorthikantiRow("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
)


def select_korthikanti_rows(names: Sequence[str] = ()) -> tuple[KorthikantiRow, ...]:
    """The rows whose name ("22B", "1T") is listed; all if none."""
    return tuple(r for r in KORTHIKANTI_TABLE if not names or r.name in names)


def recipe_of(row: KorthikantiRow, modern: bool) -> Recipe:
    """The row's published configuration: full recomputation, or (`modern`) sequence
    parallelism with selective recomputation."""
    return Recipe(
        tp=row.tp,
        pp=row.pp,
        dp=row.gpus // (row.tp * row.pp),
        microbatch_size=row.microbatch,
        remat="selective" if modern else "full",
        sequence_parallel=modern,
        schedule="interleaved" if row.virtual > 1 else "1f1b",
        virtual_stages=row.virtual,
        name="korthikanti-" + ("sp-selective" if modern else "full"),
    )


def price_row(row: KorthikantiRow) -> tuple[Cost, Cost, Cost, Cost]:
    """Both columns' predicted costs (full recomputation; SP + selective) as `am.apply`
    runs them, then both as Megatron-LM runs them (`megatron_priced`: its full
    recomputation runs each layer's forward whole, its last matmul and all-reduce included,
    which XLA's drops; its optimizer's passes over the main gradients), on one captured
    program: the row's model is captured and its cost tables built once."""
    job = row.job()
    spec, cluster = job.spec(), job.cluster_of()
    problem = Problem.build(train_step(spec), spec.abstract_args(), cluster)
    full, modern = (
        recipe_plan(problem.graph, problem.groups, cluster, recipe_of(row, m))
        for m in (False, True)
    )
    return (
        problem.estimate(full),
        problem.estimate(modern),
        megatron_priced(problem, full),
        megatron_priced(problem, modern),
    )


def korthikanti_record(row: KorthikantiRow, plan_s: float = 0.0, searcher: str = "auto") -> dict:
    """One row: published figures, both columns priced, and with `plan_s` > 0 the
    planner's plan found in that budget, against the modern column's predicted step."""
    start = time.perf_counter()
    full, modern, megatron, megatron_modern = price_row(row)
    record = {
        **dataclasses.asdict(row),
        "full_pred_s": full.step_time_s,
        "modern_pred_s": modern.step_time_s,
        "full_ratio": full.step_time_s / row.full_s,
        "modern_ratio": modern.step_time_s / row.modern_s,
        "published_speedup": row.published_speedup,
        "predicted_speedup": full.step_time_s / modern.step_time_s,
        # Both columns as Megatron-LM runs them (its whole layer forward again under full
        # recomputation, its optimizer's passes).
        "megatron_full_pred_s": megatron.step_time_s,
        "megatron_full_ratio": megatron.step_time_s / row.full_s,
        "megatron_modern_pred_s": megatron_modern.step_time_s,
        "megatron_modern_ratio": megatron_modern.step_time_s / row.modern_s,
        "megatron_speedup": megatron.step_time_s / megatron_modern.step_time_s,
        "full_memory_gb": full.memory_bytes / 1e9,
        "modern_memory_gb": modern.memory_bytes / 1e9,
        "feasible": bool(full.feasible and modern.feasible),
        "price_s": time.perf_counter() - start,
    }
    if plan_s > 0:
        record.update(
            planner_columns(row.job(), plan_s, searcher, modern.step_time_s, "vs_published")
        )
    return record


def korthikanti_table(
    rows: Sequence[KorthikantiRow] = KORTHIKANTI_TABLE,
    plan_s: float = 0.0,
    searcher: str = "auto",
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every row (`korthikanti_record`) and the settings they ran with, with the mean
    absolute error of the eight priced iteration times."""
    records = []
    for row in rows:
        step(f"korthikanti {row.name}")
        records.append(korthikanti_record(row, plan_s, searcher))
    return {
        "cluster": CLUSTER,
        "plan_s": plan_s,
        "searcher": searcher,
        "rows": records,
        "mean_abs_error": _mean_abs_error(records, "full_ratio", "modern_ratio"),
        "megatron_mean_abs_error": _mean_abs_error(
            records, "megatron_full_ratio", "megatron_modern_ratio"
        ),
    }


def _mean_abs_error(records: Sequence[dict], *keys: str) -> float:
    """Mean absolute error of the priced times: the ratios `keys` of every record."""
    errors = [abs(r[k] - 1) for r in records for k in keys]
    return sum(errors) / max(len(errors), 1)
