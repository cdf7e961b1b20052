"""ILP solve times on the shard space (issue 4 asks for them): one MILP per mesh and ZeRO
stage at most, HiGHS through highspy, against the best expert plan under the same cost model.

    python benchmarks/bench_ilp.py                 # bert-large/16, gpt-1.3b/32, gpt-6.7b/64
    python benchmarks/bench_ilp.py --fine          # also the per-group space (no grouping)
    python benchmarks/bench_ilp.py mlp:8 bert-base:16

Columns: units and points of the space (layer-grouped unless "fine"; points past 1e6 per
mesh are the product of the per-unit option counts, an upper bound); MILPs solved (per
mesh ZeRO-0 without a memory limit, a lower bound, then ZeRO 0/2/3 under the limit only
when that bound could still win and its plan does not fit); factors and columns
(binaries plus joint-option variables) of the largest MILP; HiGHS time summed over the
MILPs; the whole search's wall time (factor building included); whether every MILP was
proven optimal, and the worst gap; the ILP's step time, the best expert's and their
ratio (both priced by `CostModel.estimate`, as plans are). Single-threaded numpy; HiGHS
picks its own threads.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from automap._cluster import Cluster
from automap._search import Problem, fine_space, run_searcher, search_ilp
from automap._space import ShardSpace
from automap._zoo import get_model

CASES = (("bert-large", 16), ("gpt-1.3b", 32), ("gpt-6.7b", 64))
HEADER = (
    f"{'model':<11} {'dev':>4} {'space':<7} {'units':>5} {'points':>9} {'milps':>5} "
    f"{'factors':>7} {'columns':>7} {'solve s':>8} {'wall s':>7} {'optimal':>7} {'gap':>7} "
    f"{'ilp ms':>9} {'expert ms':>9} {'ilp/exp':>8}  best expert"
)


def row(name: str, devices: int, label: str, space: ShardSpace, expert) -> str:
    start = time.perf_counter()
    point, stats = search_ilp(space)
    wall = time.perf_counter() - start
    # Priced as run_searcher prices plans (CostModel.estimate), like the expert column.
    found = space.to_plan(*point, name="ilp").predicted if point else None
    ilp_ms = f"{found.step_time_s * 1e3:9.4g}" if found else f"{'none':>9}"
    expert_ms = f"{expert.predicted.step_time_s * 1e3:9.4g}" if expert else f"{'none':>9}"
    ratio = (
        f"{found.step_time_s / expert.predicted.step_time_s:8.6f}"
        if found and expert
        else f"{'-':>8}"
    )
    plan = f"{expert.name} " if expert else ""
    if point:
        plan += f"| ilp: {space.meshes[point[0]]} zero {point[2]}"
    return (
        f"{name:<11} {devices:>4} {label:<7} {len(space.units):>5} {space.size():>9.2e} "
        f"{stats['evaluated']:>5} {stats['factors']:>7} {stats['variables']:>7} "
        f"{stats['solve_time_s']:>8.2f} {wall:>7.2f} {stats['optimal']!s:>7} "
        f"{stats['gap']:>7.1e} {ilp_ms} {expert_ms} {ratio}  {plan}"
    )


def main(argv: list[str]) -> None:
    fine = "--fine" in argv
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in argv if not a.startswith("--")]
    print(HEADER)
    for name, devices in cases or CASES:
        spec = get_model(name)
        problem = Problem.build(spec.step_fn, spec.abstract_args(), Cluster.preset("a100", devices))
        try:
            expert = run_searcher(problem, "expert", budget_s=60, seed=0)
        except Exception:  # no feasible expert plan: the ILP row still stands
            expert = None
        space = ShardSpace(problem.graph, problem.groups, problem.cluster, problem.cost_model)
        print(row(name, devices, "grouped", space, expert), flush=True)
        if fine:
            print(row(name, devices, "fine", fine_space(space), expert), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
