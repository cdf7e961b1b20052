"""The dp searcher (exact stage cuts over the hybrid space) against the DQN's hybrid task.

    python benchmarks/bench_pipeline_dqn.py                  # gpt-1.3b on a100x32, and a small row
    python benchmarks/bench_pipeline_dqn.py --budget 60 --rows small
    python benchmarks/bench_pipeline_dqn.py --budget 60 --rows sc21-1.7B,korthikanti-22B

Per row: the dp searcher's plan and the DQN hybrid plan under the same budget_s, each with
its step time, its shape (mesh, microbatches, schedule and techniques) and wall time, and
the ratio DQN / dp (below 1: the DQN's plan is faster). The problem is built once per row,
outside the clocks. Besides the zoo rows, two published ones (issue 26 item 6): SC'21's
1.7B row (32 A100s) and Korthikanti et al.'s 22B row (8 A100s), their models as
`automap bench` prices them (`_bench.job_of`, the Korthikanti row's `job`).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import automap as am
from automap._bench import KORTHIKANTI_TABLE, MEGATRON_TABLE, job_of, plan_shape, train_step
from automap._search import Problem, run_searcher
from automap._zoo import get_model

# name -> (zoo model, overrides, chip, devices)
ROWS = {
    "small": ("gpt2-xl", dict(layers=8, hidden=256, heads=8, batch=32, seq=64), "a100", 16),
    "gpt-1.3b": ("gpt-1.3b", {}, "a100", 32),
}


# name -> the published row's job (model settings, cluster, devices)
PUBLISHED = {
    "sc21-1.7B": lambda: job_of(next(r for r in MEGATRON_TABLE if r.params_b == 1.7)),
    "korthikanti-22B": lambda: next(r for r in KORTHIKANTI_TABLE if r.name == "22B").job(),
}


def problem_of(name: str) -> tuple[Problem, str]:
    if name in PUBLISHED:
        job = PUBLISHED[name]()
        spec, cluster = job.spec(), job.cluster_of()
        step = train_step(spec)  # donating its state, as the published runs update in place
    elif name in ROWS:
        model, overrides, chip, devices = ROWS[name]
        spec, cluster = get_model(model, **overrides), am.Cluster.preset(chip, devices)
        step = spec.step_fn
    else:
        raise SystemExit(f"unknown row {name!r}: use one of {sorted([*ROWS, *PUBLISHED])}")
    problem = Problem.build(step, spec.abstract_args(), cluster)
    return problem, f"{name} {cluster.name}x{cluster.devices}"


def _row(name: str, budget: float, seed: int) -> dict:
    problem, label = problem_of(name)
    out = {"row": label}
    for searcher, task in (("dp", "hybrid"), ("dqn", "hybrid")):
        start = time.perf_counter()
        plan = run_searcher(problem, searcher, budget, seed, task=task)
        out[searcher] = (plan, time.perf_counter() - start)
    return out


def _describe(plan: am.Plan) -> str:
    return plan_shape(plan)


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
