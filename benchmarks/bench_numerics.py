"""The numerics check over third-party programs: every expert plan and searched plan of
Hugging Face Flax BERT (masked LM, optax Adam) and Keras-Hub GPT-2 (causal LM, Keras's
stateless loop, Adam), small variants, at float32 and bf16 compute, on 8 CPU devices.

Each plan is run (`am.apply`) and its outputs compared with the one-device step as
`am.verify` compares them (`compare_outputs`, with the captured step's roles and compute
dtypes, and the step rerun with its inputs split as the measured noise). The table gives
the verdict, the largest error of the leaf the verdict names, and the closest call: the
leaf whose largest error/tolerance ratio is highest, with that error and tolerance. A
ratio of 1 is the edge; a correct plan should stay well under it. Per model and dtype, one
deliberately broken step runs too: data parallelism without its gradient all-reduce
(every device's state updated from its own eighth of the batch), which must be DIFFERENT.

The CPU's vector width changes how XLA's kernels block their sums; reproduce a CPU
without AVX-512 in a fresh process (the flag must be set before JAX starts):

    python benchmarks/bench_numerics.py
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/bench_numerics.py --json avx2.json
    python benchmarks/bench_numerics.py --models hf_bert --dtypes bfloat16 --budget 5

At eee7017 + b2f38ca (2026-12-04, a shared 2-core machine with AVX-512, at load ~8):
default ISA 8 min 41 s, AVX2 20 min. Per model x dtype, 10 plans (8 experts, auto, ilp),
equal under both ISAs, no plan DIFFERENT, the broken step DIFFERENT in each:

    model       dtype     equal  closest ratio (leaf)                broken ratio
    hf_bert     float32   10/10  0.297 (megatron_3d, a key bias)     1.2e5 (the loss)
    hf_bert     bfloat16  10/10  0.941 (megatron_dp: a flipped update) 15.1 (a mu)
    keras_gpt2  float32   10/10  0.220 (megatron_3d, [1][21])        4.6e5 (the loss)
    keras_gpt2  bfloat16  10/10  0.892 (gpipe: a flipped update)     18.3 (a mu)

The ratios near 0.9 are Adam's flipped updates (+lr to -lr), which the rule allows by
construction (FLIP x the leaf's largest update, plus the floor): not a rounding gamble.
Before b2f38ca keras_gpt2 bf16 megatron came to 0.895 on `[3][13]`, the key bias's second
moment held to its own ~1e-15 (Keras's flat optimizer list gave each moment a family of its
own); now 0.311. Of 44 rows, 41 had the same errors under both ISAs; keras_gpt2 float32
megatron_dp, auto and ilp's largest error went from 9.5e-7 to 7.5e-8 under AVX2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import automap as am  # noqa: E402
from automap._verify import compare_outputs, margins, reordered  # noqa: E402

CPU8 = am.Cluster.preset("cpu", devices=8)
SEARCHERS = ("auto", "ilp")
# Smaller than the examples' SMALL in sequence, to keep a plan to seconds on two cores;
# 8 devices still divide every dimension.
SIZES = {
    "hf_bert": dict(batch=16, seq=32),
    "keras_gpt2": dict(batch=16, seq=32),
}


def program(name: str, dtype: str):
    """(step, concrete args) of a third-party example at `dtype` compute."""
    if name == "hf_bert":
        from examples.hf_bert import make_step
    else:
        from examples.keras_gpt2 import make_step
    return make_step(dtype=dtype, **SIZES[name])


def _fresh(args):
    """Host copies: a run that donates cannot touch the arguments the comparison reads."""
    return jax.tree.map(np.array, args)


def plans_of(step, args, budget_s: float) -> dict[str, am.Plan]:
    plans = dict(am.expert_plans(step, *args, cluster=CPU8))
    for searcher in SEARCHERS:
        plans[searcher] = am.plan(step, *args, cluster=CPU8, searcher=searcher, budget_s=budget_s)
    return plans


def _row(name, dtype, label, plan, got, want, graph, args, noise) -> dict:
    verdict = compare_outputs(got, want, graph=graph, before=args, noise=noise)
    closest = margins(got, want, graph=graph, before=args, noise=noise)
    leaf, (err, tol) = max(closest.items(), key=lambda kv: kv[1][0] / kv[1][1] if kv[1][1] else 0)
    return dict(
        model=name,
        dtype=dtype,
        plan=label,
        mesh=dict(plan.mesh) if plan else {},
        equal=bool(verdict.equal),
        max_abs_err=verdict.max_abs_err,
        leaf=verdict.leaf,
        closest_leaf=leaf,
        closest_err=err,
        closest_tol=tol,
        ratio=err / tol if tol else float("inf"),
    )


def _print(row: dict, seconds: float) -> None:
    mesh = "x".join(f"{k}{v}" for k, v in row["mesh"].items()) or "-"
    print(
        f"{row['model']:<10} {row['dtype']:<8} {row['plan']:<18} {mesh:<18} "
        f"{'equal' if row['equal'] else 'DIFFERENT':<9} {row['max_abs_err']:9.2e} "
        f"{row['closest_err']:9.2e} {row['closest_tol']:9.2e} {row['ratio']:6.3f} "
        f"{seconds:5.1f}s  {row['closest_leaf'] if row['equal'] else row['leaf']}",
        flush=True,
    )


def bench(name: str, dtype: str, budget_s: float) -> list[dict]:
    step, args = program(name, dtype)
    graph = am.capture(step, *args)
    cpus = jax.devices("cpu")
    want = jax.jit(step)(*jax.device_put(_fresh(args), cpus[0]))
    noises: dict[int, object] = {}
    rows = []
    for label, plan in plans_of(step, args, budget_s).items():
        t0 = time.perf_counter()
        if plan.devices not in noises:  # as am.verify: the step rerun split over its devices
            noises[plan.devices] = reordered(step, _fresh(args), cpus[: max(plan.devices, 2)])
        got = am.apply(step, plan)(*_fresh(args))
        row = _row(name, dtype, label, plan, got, want, graph, args, noises[plan.devices])
        rows.append(row)
        _print(row, time.perf_counter() - t0)
    # Broken on purpose: each device's state stepped on its own share of the batch, never
    # all-reduced (device 0's share here): the moments and the loss are those of 1/8 of it.
    t0 = time.perf_counter()
    *state, batch = args
    share = jax.tree.map(lambda x: x[: len(x) // len(cpus)], batch)
    got = jax.jit(step)(*_fresh((*state, share)))
    row = _row(name, dtype, "BROKEN no-allreduce", None, got, want, graph, args, noises.get(8))
    rows.append(row)
    _print(row, time.perf_counter() - t0)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--budget", type=float, default=10.0, help="seconds per searcher")
    parser.add_argument("--json", help="write the rows to this file")
    opts = parser.parse_args(argv)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(
        f"{'model':<10} {'dtype':<8} {'plan':<18} {'mesh':<18} {'verdict':<9} {'max err':>9} "
        f"{'close err':>9} {'tol':>9} {'ratio':>6}  time   leaf (closest, or the failing one)"
    )
    rows = [row for m in opts.models for d in opts.dtypes for row in bench(m, d, opts.budget)]
    print()
    for m in opts.models:
        for d in opts.dtypes:
            mine = [r for r in rows if (r["model"], r["dtype"]) == (m, d)]
            plans = [r for r in mine if not r["plan"].startswith("BROKEN")]
            broken = [r for r in mine if r["plan"].startswith("BROKEN")]
            print(
                f"{m:<10} {d:<8} plans {len(plans):>2}: equal {sum(r['equal'] for r in plans):>2}, "
                f"different {sum(not r['equal'] for r in plans):>2}; closest ratio "
                f"{max(r['ratio'] for r in plans):.3f}; broken caught "
                f"{sum(not r['equal'] for r in broken)} of {len(broken)}"
            )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
