"""What rematerialization does to the compiled step, next to what the cost model says.

    python benchmarks/bench_remat.py                       # the zoo GPT of tests/test_remat.py
    python benchmarks/bench_remat.py layers=8 seq=128      # other overrides

For one device, the step compiled plain and with `remat=True` through `am.apply`: XLA's
temporaries (`memory_analysis().temp_size_in_bytes`), FLOPs (`cost_analysis()`) and
matmuls (dot instructions of the optimized HLO), and the cost model's activation bytes and
recomputed FLOPs. Runs on the CPU with 8 virtual devices, about a minute on one core.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import automap as am  # noqa: E402
from automap._capture import capture  # noqa: E402
from automap._cluster import Cluster  # noqa: E402
from automap._cost import CostModel  # noqa: E402
from automap._groups import build_groups  # noqa: E402
from automap._plan import Plan  # noqa: E402
from automap._remat import recompute_plan  # noqa: E402
from automap._zoo import get_model  # noqa: E402

CONFIG = dict(layers=4, hidden=64, heads=2, batch=8, seq=64, vocab=128, dtype="float32")


def main(argv: list[str]) -> None:
    overrides = dict(CONFIG, **dict(a.split("=", 1) for a in argv))
    spec = get_model("gpt2-xl", **overrides)
    args = spec.abstract_args()
    graph = capture(spec.step_fn, *args)
    groups = build_groups(graph)
    rc = recompute_plan(graph, groups)
    model = CostModel(graph, Cluster.preset("cpu", devices=1), groups)
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    specs = {jax.tree_util.keystr(p): () for p, _ in flat}
    print(f"gpt2-xl {overrides}: {len(rc.layers)} layers recomputed, {len(rc.ops)} ops")
    print(f"{'':6} {'XLA temp B':>12} {'XLA flops':>14} {'dots':>5} {'pred. acts B':>13}")
    for remat in (False, True):
        prepared = am.apply(
            spec.step_fn, Plan(mesh={}, specs=specs, remat=remat), devices=jax.devices()[:1]
        ).prepare(*args)
        compiled = prepared.compile(args)
        ca = compiled.cost_analysis()
        flops = (ca[0] if isinstance(ca, list) else ca)["flops"]
        dots = len(re.findall(r"= \S+ dot\(", compiled.as_text()))
        acts = model.evaluate({}, {}, remat=remat).memory_breakdown["activations"]
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(
            f"{'remat' if remat else 'plain':6} {temp:>12,} {flops:>14,.0f} {dots:>5} {acts:>13,.0f}"
        )
    again = sum(graph.ops[i].flops for i in rc.ops)
    print(f"recomputed FLOPs, predicted: {again:,.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
