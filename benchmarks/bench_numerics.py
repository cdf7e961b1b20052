"""The numerics check over third-party programs: every expert and searched plan, run.

Issue 28 asks that the numerics check (`am.verify` with concrete arguments: the plan run
on a device mesh against `jax.jit` of the same step, `_verify/_numerics.compare_outputs`)
pass every correct plan of the zoo and of third-party programs at float32 and bf16 on
any x86-64 CPU. `tests/test_numerics.py` runs the zoo's plans in the suite; this runs
Hugging Face Flax BERT and Keras-Hub GPT-2 (`examples/`, small configs, random weights),
each at float32 and bf16, over every expert plan of 8 A100s and the plans of the `auto`
and `ilp` searchers, on 8 CPU devices. Run it again under a CPU's narrower vector width,
which changes XLA's rounding (set before JAX starts, so in the environment):

    python benchmarks/bench_numerics.py
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/bench_numerics.py

A plan reported DIFFERENT here is a false alarm or a real bug, either one a defect.

At 8ac2549 (2026-12-04, an AMD EPYC with AVX-512): 40 of 40 plans equal at XLA's default
flags (166 s) and 40 of 40 under `--xla_cpu_max_isa=AVX2` (145 s): per model and dtype,
the 8 expert plans and the auto and ilp plans; largest errors 8.2e-07 (float32) and
1.9e-04 (bf16), each within the tolerance the step's structure gives it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 8)

import automap as am  # noqa: E402

MODELS = ("hf_bert", "keras_gpt2")
DTYPES = ("float32", "bfloat16")


def program(name: str, dtype: str):
    """(step, concrete args) of a third-party example; its state is not donated, so the
    same arguments serve the plan's run and the reference's."""
    if name == "hf_bert":
        from examples.hf_bert import make_step
    else:
        from examples.keras_gpt2 import make_step
    return make_step(dtype=dtype, donate=False)


def plans_of(step, args, budget_s: float) -> dict[str, am.Plan]:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    a100 = am.Cluster.preset("a100", devices=8)
    plans = dict(am.expert_plans(step, *abstract, cluster=a100))
    for searcher in ("auto", "ilp"):
        plans[searcher] = am.plan(
            step, *abstract, cluster=a100, searcher=searcher, budget_s=budget_s
        )
    return plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--budget", type=float, default=10.0)
    opts = parser.parse_args(argv)
    isa = os.environ.get("XLA_FLAGS", "") or "default flags"
    print(f"{'model':<11} {'dtype':<9} {'plan':<16} {'mesh':<18} numerics  max abs error")
    counts: dict[tuple[str, str], list[int]] = {}
    start = time.perf_counter()
    for name in opts.models:
        for dtype in opts.dtypes:
            step, args = program(name, dtype)
            for label, plan in plans_of(step, args, opts.budget).items():
                report = am.verify(step, plan, *args)
                mesh = "x".join(f"{k}{v}" for k, v in plan.mesh.items())
                verdict = "equal" if report.numerics_ok else "DIFFERENT"
                tally = counts.setdefault((name, dtype), [0, 0])
                tally[0] += 1
                tally[1] += bool(report.numerics_ok)
                print(
                    f"{name:<11} {dtype:<9} {label:<16} {mesh:<18} {verdict:<9} "
                    f"{report.max_abs_err:.2e}",
                    flush=True,
                )
    print(f"\n{isa}, {time.perf_counter() - start:.0f} s:")
    for (name, dtype), (plans, equal) in counts.items():
        print(f"  {name} {dtype}: {equal} of {plans} plans equal")
    return 0 if all(p == e for p, e in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
