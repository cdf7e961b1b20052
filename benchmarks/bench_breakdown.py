"""Where a published row's predicted step goes: matmuls, memory-bound kernels,
collectives, and on pipelined rows the stages, bubble and sends.

The Korthikanti et al. rows (`automap._bench.KORTHIKANTI_TABLE`) priced with their
published configuration, full recomputation and sequence parallelism + selective
recomputation, each split into its parts: the per-op compute of one device by
primitive (dot_general is the matmuls, the rest memory-bound kernels; recomputation's
second forward is the difference to `compute`), its collectives by kind, and for a
pipelined row one stage's forward and backward per microbatch, the cut's send lag and
the bubble. The figures to read before changing a time term (issues 26, 27).
Narayanan et al.'s SC'21 rows (`automap._bench.MEGATRON_TABLE`, named "sc21:" and the
parameter count as printed) are priced with Megatron's configuration (microbatch 1, full
recomputation, 1F1B); every one of them runs microbatches, so each prints by stage.

    python benchmarks/bench_breakdown.py 22B      # one stage: by primitive (30 s)
    python benchmarks/bench_breakdown.py 175B     # pipelined: by stage (minutes)
    python benchmarks/bench_breakdown.py sc21:18.4 sc21:39.1   # SC'21 rows, by stage
    python benchmarks/bench_breakdown.py waves    # wave quantization on the SC'21 rows

`waves` prints what wave quantization, which the cost model does not price, would keep
of each SC'21 row's layer GEMM rate: a GEMM's output tiles run in waves of one tile per
SM (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799, wave
quantization: 108 SMs on the A100, its example tile 256 x 128), so a last wave part
full idles the rest. Shapes are a layer's per device at microbatch 1 (M = 2048 tokens):
QKV, projection, MLP in and out, each forward, input gradient and weight gradient.

Abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import collections
import math
import sys

from automap import Cost
from automap._bench import KORTHIKANTI_TABLE
from automap._bench._isolated import train_step
from automap._bench._korthikanti import recipe_of
from automap._bench._megatron import MEGATRON_TABLE, job_of, tflops_per_gpu
from automap._cost import estimate_pipeline
from automap._search import Problem
from automap._space import Recipe, recipe_plan


def one_stage(problem: Problem, plan) -> None:
    cost = problem.estimate(plan)
    by_kind: collections.Counter = collections.Counter()
    for i, seconds, _ in cost.per_op:
        by_kind[problem.graph.ops[i].primitive] += seconds
    matmul = by_kind.pop("dot_general", 0.0)
    kernels = sum(by_kind.values())
    print(
        f"  step {cost.step_time_s:.3f} s: compute {cost.compute_s:.3f} (matmuls "
        f"{matmul:.3f}, memory-bound {kernels:.3f}, recompute "
        f"{cost.compute_s - matmul - kernels:.3f}), collectives {cost.comm_s:.3f}"
    )
    for name, seconds in by_kind.most_common(6):
        print(f"    {name:22s} {seconds:.4f} s")
    for c in cost.collectives:
        print(
            f"    {c.kind:15s} on {c.axis}: {c.bytes / 1e9:.2f} GB in {c.count}: {c.time_s:.4f} s"
        )


def pipelined(problem: Problem, plan) -> Cost:
    pc = estimate_pipeline(problem.cost_model, plan)
    cost = pc.cost
    fwd, bwd = pc.stage_times[0][0], sum(pc.stage_times[0][1:])
    print(
        f"  step {cost.step_time_s:.3f} s: bubble {cost.bubble_s:.3f}, collectives "
        f"{cost.comm_s:.3f}; stage 0 per microbatch fwd {fwd * 1e3:.1f} ms, bwd "
        f"{bwd * 1e3:.1f} ms; x{pc.microbatches} = {(fwd + bwd) * pc.microbatches:.3f} s"
    )
    per_stage = " ".join(f"{sum(t) * 1e3:.1f}" for t in pc.stage_times)
    print(f"  per microbatch, fwd + bwd by stage (ms): {per_stage}")
    print(
        f"  send lag per cut {max(pc.send_s, default=0) * 1e3:.2f} ms; stage 0 sends "
        f"{pc.sends.sent_bytes[0] / 1e9:.2f} GB in {pc.sends.sent_count[0]} messages, "
        f"{pc.sends.sent_s[0]:.3f} s"
    )
    for c in cost.collectives:
        print(
            f"    {c.kind:18s} on {c.axis}: {c.bytes / 1e9:.2f} GB in {c.count}: {c.time_s:.4f} s"
        )
    return cost


def sc21(names: list[str]) -> None:
    for row in (r for r in MEGATRON_TABLE if f"sc21:{r.params_b:g}" in names):
        job = job_of(row)
        spec = job.spec()
        problem = Problem.build(train_step(spec), spec.abstract_args(), job.cluster_of())
        recipe = Recipe(tp=row.tp, pp=row.pp, dp=row.dp, microbatch_size=1, remat="full")
        plan = recipe_plan(problem.graph, problem.groups, problem.cluster, recipe)
        print(f"SC'21 {row.params_b:g}B ({row.tp} x {row.pp} x {row.dp}):")
        step = pipelined(problem, plan).step_time_s
        print(
            f"  published {row.published} TFLOP/s per GPU, predicted "
            f"{tflops_per_gpu(row, step):.0f}"
        )


def wave_efficiency(m: int, n: int, tile: tuple[int, int], sms: int) -> float:
    """The useful fraction of an m x n output's waves of `tile` tiles over `sms` SMs."""
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    return tiles / sms / math.ceil(tiles / sms)


def layer_waves(hidden: int, tp: int, tile: tuple[int, int], sms: int = 108) -> float:
    """FLOP-weighted wave efficiency of a Megatron layer's GEMMs per device (M = 2048)."""
    m, h = 2048, hidden
    work = slowed = 0.0
    for n, k in ((3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp)):
        # forward (out m x n), input gradient (out m x k), weight gradient (out k x n)
        for a, b in ((m, n), (m, k), (k, n)):
            flops = 2.0 * m * n * k
            work += flops
            slowed += flops / wave_efficiency(a, b, tile, sms)
    return work / slowed


def waves() -> None:
    for tile in ((256, 128), (128, 128)):
        cells = " ".join(
            f"{r.params_b:g}B {layer_waves(r.hidden, r.tp, tile):.3f}" for r in MEGATRON_TABLE
        )
        print(f"tile {tile[0]} x {tile[1]} on 108 SMs: {cells}")


def main(argv: list[str]) -> int:
    names = argv or ["22B"]
    if "waves" in names:
        waves()
    sc21(names)
    for row in (r for r in KORTHIKANTI_TABLE if r.name in names):
        job = row.job()
        spec = job.spec()
        problem = Problem.build(train_step(spec), spec.abstract_args(), job.cluster_of())
        for modern in (False, True):
            plan = recipe_plan(
                problem.graph, problem.groups, problem.cluster, recipe_of(row, modern)
            )
            published = row.modern_s if modern else row.full_s
            print(
                f"{row.name} {'SP + selective' if modern else 'full recompute'}: published {published} s"
            )
            (pipelined if plan.pipelined else one_stage)(problem, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
