"""How fast the cost model scores plans: full evaluations and one-group deltas per second.

    python benchmarks/bench_cost.py                 # every zoo model
    python benchmarks/bench_cost.py bert-large mlp  # some of them

Plans are random valid assignments (an axis on a group only where it divides the group and
no other group of a shared tensor holds it) on a {data, model} mesh of the model's preset
cluster (16 devices), as the shard space's searchers produce them. Single-threaded numpy.
"""

from __future__ import annotations

import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._groups import build_groups
from automap._zoo import get_model, list_models

MESH = {"data": 4, "model": 4}


def random_assignments(groups, n: int, seed: int = 0) -> list[dict[int, str]]:
    rng = random.Random(seed)
    decisions = list(groups.decision_groups())
    neighbours = {g: set() for g in decisions}
    for tensor_groups in groups.tensor_groups:
        present = {g for g in tensor_groups if g in neighbours}
        for g in present:
            neighbours[g] |= present - {g}
    out = []
    for _ in range(n):
        order = decisions[:]
        rng.shuffle(order)
        assignment: dict[int, str] = {}
        for g in order:
            axis = rng.choice([None, "data", "model"])
            fits = axis and groups.groups[g].divisor % MESH[axis] == 0
            if fits and all(assignment.get(x) != axis for x in neighbours[g]):
                assignment[g] = axis
        out.append(assignment)
    return out


def rate(fn, items, min_time: float = 1.0) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        for item in items:
            fn(item)
        done += len(items)
    return done / (time.perf_counter() - start)


def bench(name: str) -> dict[str, float]:
    spec = get_model(name)
    t0 = time.perf_counter()
    graph = capture(spec.step_fn, *spec.abstract_args())
    t1 = time.perf_counter()
    groups = build_groups(graph)
    model = CostModel(graph, Cluster.preset("a100", devices=16), groups)
    t2 = time.perf_counter()
    plans = random_assignments(groups, 64)
    full = rate(lambda a: model.evaluate(a, MESH), plans)
    base = model.state(plans[0], MESH)
    moves = [{g: axis} for g in groups.decision_groups() for axis in (None, "data", "model")]
    delta = rate(lambda mv: model.evaluate_delta(base, mv), moves[:64] or [{}])
    stats = groups.stats()
    return {
        "ops": len(graph.ops),
        "groups": stats["groups"],
        "decisions": stats["decisions"],
        "classes": stats["decisions_layer_grouped"],
        "capture_s": t1 - t0,
        "build_s": t2 - t1,
        "plans_per_s": full,
        "deltas_per_s": delta,
    }


def main(names: list[str]) -> None:
    names = names or [m.name for m in list_models()]
    header = f"{'model':<12} {'ops':>6} {'groups':>6} {'dec':>4} {'cls':>4} {'capture':>8} {'build':>6} {'plans/s':>8} {'deltas/s':>8}"
    print(header)
    for name in names:
        r = bench(name)
        print(
            f"{name:<12} {r['ops']:>6} {r['groups']:>6} {r['decisions']:>4} {r['classes']:>4} "
            f"{r['capture_s']:>7.1f}s {r['build_s']:>5.1f}s {r['plans_per_s']:>8.0f} "
            f"{r['deltas_per_s']:>8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
