"""Where a published row's predicted step goes: matmuls, memory-bound kernels,
collectives, and on pipelined rows the stages, bubble and sends.

The Korthikanti et al. rows (`automap._bench.KORTHIKANTI_TABLE`) priced with their
published configuration, full recomputation and sequence parallelism + selective
recomputation, each split into its parts: the per-op compute of one device by
primitive (dot_general is the matmuls, the rest memory-bound kernels; recomputation's
second forward is the difference to `compute`), its collectives by kind, and for a
pipelined row one stage's forward and backward per microbatch, the cut's send lag and
the bubble. The figures to read before changing a time term (issues 26, 27).

    python benchmarks/bench_breakdown.py 22B      # one stage: by primitive (30 s)
    python benchmarks/bench_breakdown.py 175B     # pipelined: by stage (minutes)

Abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import collections
import sys

from automap._bench import KORTHIKANTI_TABLE
from automap._bench._isolated import train_step
from automap._bench._korthikanti import recipe_of
from automap._cost import estimate_pipeline
from automap._search import Problem
from automap._space import recipe_plan


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


def pipelined(problem: Problem, plan) -> None:
    pc = estimate_pipeline(problem.cost_model, plan)
    cost = pc.cost
    fwd, bwd = pc.stage_times[0][0], sum(pc.stage_times[0][1:])
    print(
        f"  step {cost.step_time_s:.3f} s: bubble {cost.bubble_s:.3f}, collectives "
        f"{cost.comm_s:.3f}; stage 0 per microbatch fwd {fwd * 1e3:.1f} ms, bwd "
        f"{bwd * 1e3:.1f} ms; x{pc.microbatches} = {(fwd + bwd) * pc.microbatches:.3f} s"
    )
    print(
        f"  send lag per cut {max(pc.send_s, default=0) * 1e3:.2f} ms; stage 0 sends "
        f"{pc.sends.sent_bytes[0] / 1e9:.2f} GB in {pc.sends.sent_count[0]} messages, "
        f"{pc.sends.sent_s[0]:.3f} s"
    )
    for c in cost.collectives:
        print(
            f"    {c.kind:18s} on {c.axis}: {c.bytes / 1e9:.2f} GB in {c.count}: {c.time_s:.4f} s"
        )


def main(argv: list[str]) -> int:
    names = argv or ["22B"]
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
