"""Megatron-LM's published weak-scaling table, priced by Auto-MAP, and Auto-MAP's own plans.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT with vocabulary 51,200 and sequence 2048 on A100 80 GB
(8 per node), mixed precision, full activation recomputation, 1F1B, microbatch size 1.
Each row is priced with Megatron's own configuration (`am.Recipe`: TP inside the node, PP
stages equal in layers, DP over the rest) and its TFLOP/s per GPU compared with the
published one, by the paper's count: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step.
With `--plan SECONDS`, the planner (`am.plan`, the given searcher) also runs on the same
model and cluster, and its plan's predicted step time is set beside Megatron's.

    python benchmarks/bench_megatron.py                 # price every row (a few minutes)
    python benchmarks/bench_megatron.py --plan 600      # and plan each row (long)

Planning uses abstract shapes only: no weights are allocated.

Memory-bound work is priced by kernel, as XLA fuses it (`_cost/_tables.py`): the causal
mask is regenerated in each fusion, the softmax row sum runs in the kernel that writes
exp(x - max) (GPU multi-output fusion), a producer two kernels need is read by both, and
under full recomputation the first forward writes none of what the recompute makes again.
The one-stage rows moved from 0.78-0.83 to 0.81-0.86 of the published figure with that.
What still differs from Megatron: the zoo GPT's softmax runs in float32 and keeps exp(x - max)
in float32 (Megatron's fused kernel reads and writes 16-bit values), its layer norms,
residual adds and GELU are separate fused kernels rather than Megatron's fused
bias-GELU/bias-dropout-add, and matmuls run at the cluster's `matmul_efficiency` (0.6 of
peak on the a100 preset; at that rate the 7.5B row's matmuls alone, recompute included,
take about 2.6 s of the published 3.7 s step). Neither the data-parallel all-reduce nor the
tensor-parallel ones overlap compute, in Megatron-LM of the paper (local DDP) as in XLA
without its latency-hiding scheduler (off by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

import automap as am
from automap._zoo import get_model

VOCAB, SEQ = 51200, 2048


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the published table."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    published: float  # TFLOP/s per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


TABLE = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(1008, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def model_flops(row: Row) -> float:
    """The paper's FLOPs per iteration (with recomputation's extra forward)."""
    b, s, layers, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def tflops(row: Row, step_s: float) -> float:
    return model_flops(row) / (step_s * row.gpus) / 1e12


def spec_of(row: Row):
    return get_model(
        "gpt-1.3b",
        layers=row.layers,
        hidden=row.hidden,
        heads=row.heads,
        seq=SEQ,
        vocab=VOCAB,
        batch=row.batch,
        positions="learned",
    )


def price(row: Row) -> am.Plan:
    spec = spec_of(row)
    cluster = am.Cluster.preset("a100", devices=row.gpus)
    recipe = am.Recipe(tp=row.tp, pp=row.pp, dp=row.dp, microbatch_size=1, remat="full")
    return am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=cluster)


def plan_row(row: Row, budget_s: float, searcher: str) -> tuple[am.Plan, float, float]:
    spec = spec_of(row)
    cluster = am.Cluster.preset("a100", devices=row.gpus)
    start = time.perf_counter()
    plan = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=cluster, searcher=searcher, budget_s=budget_s
    )
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return plan, time.perf_counter() - start, peak_gb


def shape(plan: am.Plan) -> str:
    mesh = " × ".join(f"{k} {v}" for k, v in plan.mesh.items())
    extra = [f"{plan.microbatches} mb"] if plan.pipelined else []
    extra += ["remat"] if plan.remat else []
    extra += [f"ZeRO-{plan.zero_stage}"] if plan.zero_stage else []
    return mesh + (f" ({', '.join(extra)})" if extra else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=float, default=0.0, help="planner budget per row (s); 0: skip")
    ap.add_argument("--searcher", default="auto")
    ap.add_argument("--rows", default="", help="comma-separated params_b values to run")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    rows = [r for r in TABLE if not args.rows or f"{r.params_b:g}" in args.rows.split(",")]
    head = "| params (B) | TP | PP | DP | GPUs | batch | published TFLOP/s | predicted | ratio | step (s) | memory (GB) | fits |"
    if args.plan:
        head += " planner's plan | its step (s) | vs Megatron | planner time (s) | peak RSS (GB) |"
    print(head)
    print("|" + "--:|" * (head.count("|") - 1))
    out = []
    for row in rows:
        t0 = time.perf_counter()
        plan = price(row)
        cost = plan.predicted
        got = tflops(row, cost.step_time_s)
        cells = [f"{row.params_b:g}", row.tp, row.pp, row.dp, row.gpus, row.batch, row.published,
                 f"{got:.0f}", f"{got / row.published:.2f}", f"{cost.step_time_s:.2f}",
                 f"{cost.memory_bytes / 1e9:.1f}", "yes" if cost.feasible else "no"]  # fmt: skip
        record = {**dataclasses.asdict(row), "predicted_tflops": got, "step_s": cost.step_time_s,
                  "memory_gb": cost.memory_bytes / 1e9, "feasible": bool(cost.feasible),
                  "price_s": time.perf_counter() - t0}  # fmt: skip
        if args.plan:
            found, wall, peak = plan_row(row, args.plan, args.searcher)
            t = found.predicted.step_time_s
            cells += [
                shape(found),
                f"{t:.2f}",
                f"{t / cost.step_time_s:.2f}",
                f"{wall:.0f}",
                f"{peak:.1f}",
            ]
            record.update(plan=shape(found), plan_step_s=t, plan_wall_s=wall, plan_peak_gb=peak)
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        out.append(record)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
