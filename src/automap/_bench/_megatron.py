"""Megatron-LM's published weak-scaling table, priced by Auto-MAP, and the planner's plans.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT with vocabulary 51,200 and sequence 2048 on A100 80 GB
(8 per node), mixed precision, full activation recomputation, 1F1B, microbatch size 1.
Each row is priced with Megatron's own configuration (`Recipe`: TP inside the node, PP
stages equal in layers, DP over the rest) and its TFLOP/s per GPU compared with the
published one, by the paper's count: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step.
With a planner budget, the planner (`plan`, searcher "auto" unless told) also runs on the
same model and cluster, in a fresh process per row (`_isolated.plan_isolated`), so that
its wall time and peak memory (the process's peak RSS) are what `automap plan` on that
row would show.

One source for `benchmarks/bench_megatron.py` and `automap bench`'s section of
BENCHMARKS.md (`_markdown.megatron_lines`). Planning uses abstract shapes only: no
weights are allocated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._cost import CostModel
from .._graph import Role
from .._plan import Cost, Plan
from .._remat import megatron_recompute
from .._search import Problem
from .._space import Recipe, recipe_plan
from ._isolated import PlanJob, planner_columns, train_step

VOCAB, SEQ = 51200, 2048
CLUSTER = "a100"


@dataclasses.dataclass(frozen=True)
class MegatronRow:
    """One row of the published table."""

    params_b: float  # billions of parameters, as published
    heads: int
    hidden: int
    layers: int
    tp: int  # tensor-parallel size (inside a node)
    pp: int  # pipeline stages
    gpus: int
    batch: int  # global batch, sequences
    published: float  # TFLOP/s per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


MEGATRON_TABLE = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(1008, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def select_rows(params_b: Sequence[str] = ()) -> tuple[MegatronRow, ...]:
    """The rows whose parameter count (as printed: "1.7", "1008") is listed; all if none."""
    return tuple(r for r in MEGATRON_TABLE if not params_b or f"{r.params_b:g}" in params_b)


def model_flops(row: MegatronRow) -> float:
    """The paper's FLOPs per iteration (with recomputation's extra forward)."""
    b, s, layers, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def tflops_per_gpu(row: MegatronRow, step_s: float) -> float:
    """TFLOP/s per GPU of a step of `step_s` seconds, by the paper's count."""
    return model_flops(row) / (step_s * row.gpus) / 1e12


def job_of(row: MegatronRow) -> PlanJob:
    """The row's model (the zoo's GPT with Megatron's fused softmax, and its gradients
    clipped to a global norm of 1.0 before Adam as Megatron-LM's `--clip-grad` default
    does) on its cluster."""
    settings = dict(
        layers=row.layers,
        hidden=row.hidden,
        heads=row.heads,
        seq=SEQ,
        vocab=VOCAB,
        batch=row.batch,
        positions="learned",
        softmax="fused",
        clip_norm=1.0,
    )
    return PlanJob("gpt-1.3b", settings, CLUSTER, row.gpus)


def price_row(row: MegatronRow) -> tuple[Cost, Cost, Cost]:
    """Megatron's configuration of the row priced by the cost model, as `am.apply` runs it
    and as Megatron-LM runs it (`megatron_priced`), and the same sizes with the 2022
    techniques (sequence parallelism where tensor parallel, selective recomputation:
    Korthikanti et al.'s recipe, what the planner is held against), on one captured
    program."""
    job = job_of(row)
    spec, cluster = job.spec(), job.cluster_of()
    recipe = Recipe(tp=row.tp, pp=row.pp, dp=row.dp, microbatch_size=1, remat="full")
    modern = dataclasses.replace(recipe, remat="selective", sequence_parallel=row.tp > 1)
    problem = Problem.build(train_step(spec), spec.abstract_args(), cluster)
    plan, modern_plan = (
        recipe_plan(problem.graph, problem.groups, cluster, r) for r in (recipe, modern)
    )
    return problem.estimate(plan), megatron_priced(problem, plan), problem.estimate(modern_plan)


# What Megatron-LM's optimizer (its 2022 `optimizer/optimizer.py`, `optimizer/clip_grads.py`)
# runs beside the layers that the zoo's step has no counterpart of, in bytes a parameter
# over the float32 main gradients: the global norm `--clip-grad` needs, a multi-tensor pass
# that reads every main gradient (4; XLA sums their squares in the kernels that widen the
# gradients for Adam), and the main-gradient buffer zeroed before each step (4; our first
# microbatch writes its sum). Adam's own pass and the copy of the updated float32
# parameters to the 16-bit ones the layers read are priced already: the zoo's step fuses
# Adam and casts its parameters once a step. Left out: the clip's scale (8 more), which
# runs only in a step whose norm is over the bound, and that is not published.
OPTIMIZER_PASS_BYTES = 8


def optimizer_passes_s(problem: Problem, cost: Cost) -> float:
    """Seconds of Megatron-LM's optimizer passes (`OPTIMIZER_PASS_BYTES` a parameter) on
    the device `cost` peaks on, at the cost model's rate for memory-bound kernels. Its
    parameters are counted from the optimizer state it holds (the step's state bytes a
    parameter), which, unlike its parameter bytes, holds no 16-bit casts."""
    graph = problem.graph
    count, state = graph.param_count(), graph.role_bytes(Role.OPT_STATE)
    held = cost.memory_breakdown.get("opt_state", 0.0) * count / max(state, 1)
    rate = problem.cluster.hbm_bandwidth * problem.cluster.memory_efficiency
    return held * OPTIMIZER_PASS_BYTES / rate


def megatron_priced(problem: Problem, plan: Plan) -> Cost:
    """`plan` priced as Megatron-LM runs it: under full recomputation each layer's forward
    run whole again (`_remat.megatron_recompute`), its last matmul and all-reduce
    included, which XLA's recompute drops; and its optimizer's passes over the main
    gradients (`optimizer_passes_s`) added to the step."""
    if plan.remat and plan.remat_policy == "full" and plan.remat_layers is None:
        rc = megatron_recompute(problem.graph, problem.groups)
        cost = CostModel(problem.graph, problem.cluster, problem.groups, rc).estimate(plan)
    else:
        cost = problem.estimate(plan)
    extra = optimizer_passes_s(problem, cost)
    step = cost.step_time_s + extra
    return dataclasses.replace(
        cost,
        step_time_s=step,
        compute_s=cost.compute_s + extra,
        mfu=cost.mfu * cost.step_time_s / step,
    )


def megatron_record(row: MegatronRow, plan_s: float = 0.0, searcher: str = "auto") -> dict:
    """One row: the published figures, Megatron's configuration priced, and with
    `plan_s` > 0 the planner's plan found in that budget."""
    start = time.perf_counter()
    cost, megatron, modern = price_row(row)
    got = tflops_per_gpu(row, cost.step_time_s)
    record = {
        **dataclasses.asdict(row),
        "dp": row.dp,
        "predicted_tflops": got,
        "ratio": got / row.published,
        # As Megatron-LM runs it (its whole layer forward again, its optimizer's passes).
        "megatron_ratio": tflops_per_gpu(row, megatron.step_time_s) / row.published,
        "step_s": cost.step_time_s,
        # The same sizes with sequence parallelism and selective recomputation.
        "modern_step_s": modern.step_time_s,
        "modern_feasible": bool(modern.feasible),
        "memory_gb": cost.memory_bytes / 1e9,
        "feasible": bool(cost.feasible),
        "price_s": time.perf_counter() - start,
    }
    if plan_s > 0:
        record.update(
            planner_columns(job_of(row), plan_s, searcher, modern.step_time_s, "vs_modern")
        )
    return record


def megatron_table(
    rows: Sequence[MegatronRow] = MEGATRON_TABLE,
    plan_s: float = 0.0,
    searcher: str = "auto",
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every row (`megatron_record`) and the settings they were run with: what
    BENCHMARKS.md's Megatron section shows."""
    records = []
    for row in rows:
        step(f"megatron {row.params_b:g}B")
        records.append(megatron_record(row, plan_s, searcher))
    return {"cluster": CLUSTER, "plan_s": plan_s, "searcher": searcher, "rows": records}
