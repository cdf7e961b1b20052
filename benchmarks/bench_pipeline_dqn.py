"""The dp searcher (exact stage cuts over the hybrid space) against the DQN's hybrid task.

    python benchmarks/bench_pipeline_dqn.py                  # gpt-1.3b on a100x32, and a small row
    python benchmarks/bench_pipeline_dqn.py --budget 60 --rows small

Per row: the dp searcher's plan and the DQN hybrid plan under the same budget_s, each with
its step time, mesh, microbatches and wall time, and the ratio DQN / dp (below 1: the DQN's
plan is faster). The problem is built once per row, outside the clocks.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import automap as am
from automap._search import Problem, run_searcher
from automap._zoo import get_model

# name -> (zoo model, overrides, chip, devices)
ROWS = {
    "small": ("gpt2-xl", dict(layers=8, hidden=256, heads=8, batch=32, seq=64), "a100", 16),
    "gpt-1.3b": ("gpt-1.3b", {}, "a100", 32),
}


def _row(name: str, budget: float, seed: int) -> dict:
    model, overrides, chip, devices = ROWS[name]
    spec = get_model(model, **overrides)
    problem = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset(chip, devices))
    out = {"row": f"{name} {chip}x{devices}"}
    for searcher, task in (("dp", "hybrid"), ("dqn", "hybrid")):
        start = time.perf_counter()
        plan = run_searcher(problem, searcher, budget, seed, task=task)
        out[searcher] = (plan, time.perf_counter() - start)
    return out


def _describe(plan: am.Plan) -> str:
    return f"{plan.mesh} m={plan.microbatches}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="small,gpt-1.3b")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    header = (
        f"{'row':<22} {'dp ms':>9} {'dp s':>7} {'dqn ms':>9} {'dqn s':>7} {'dqn/dp':>7}"
        "  dp plan | dqn plan"
    )
    print(f"budget_s = {args.budget:g} per searcher, seed {args.seed}")
    print(header)
    print("-" * len(header))
    for name in args.rows.split(","):
        r = _row(name, args.budget, args.seed)
        (dp, dp_s), (dqn, dqn_s) = r["dp"], r["dqn"]
        a, b = dp.predicted.step_time_s, dqn.predicted.step_time_s
        print(
            f"{r['row']:<22} {a * 1e3:>9.3f} {dp_s:>7.1f} {b * 1e3:>9.3f} {dqn_s:>7.1f} "
            f"{b / a:>7.3f}  {_describe(dp)} | {_describe(dqn)} ({dqn.name})",
            flush=True,
        )


if __name__ == "__main__":
    main()
