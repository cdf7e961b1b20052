"""Memory of Megatron's recipes on reduced GPTs: the cost model's peak per device (per
stage for pipelines) against XLA's buffer assignment, as `am.verify` reports them.

The Megatron table (`benchmarks/bench_megatron.py`) prices Megatron-LM's configurations
at full size, where no XLA program can be compiled on this machine. This run compiles the
same recipes (`am.Recipe`: tensor parallel, pipeline stages, data parallel, full
recomputation, 4 microbatches; the fused softmax) on GPTs of 4 layers on 8 virtual CPU
devices, the step jitted with its state donated as a training loop does, and prints
predicted / XLA for each.

    python benchmarks/bench_recipe_memory.py            # both sizes, bf16 and float32
    python benchmarks/bench_recipe_memory.py --hidden 128 --dtypes float32
    python benchmarks/bench_recipe_memory.py --hidden 512 --target a100   # 1 min

Measured at 476e55a (jax 0.10.2 CPU, 4 min): float32, 10 of 12 within 15% (every
pipeline and every recipe with recomputation, 0.87-1.11x; one stage without
recomputation is over-predicted, 1.23-1.26x); bfloat16, 6 of 12 (0.75-0.97x, under: XLA's
CPU runs bf16 matmuls in float32). `bench_memory.py`'s docstring has the table and what
each miss is.

With `--target a100` the one-stage recipes compile for an A100 without one
(`automap._verify._gpu`) and are priced as the a100 preset prices them; pipelines are
skipped (their programs compile on the CPU). Measured at 5158eeb (2026-12-02, 1 min): 6
of 12 within 15%: bf16 0.83-1.06x (tp 4 with recomputation under, 0.83-0.85x), float32
1.05-1.25x (over on hidden 64 and without recomputation). With the scheduled step's
busiest moment priced (`Lowering.frees_at_last_use`, at 5aa2397): float32 6 of 6
(0.90-1.06x), bfloat16 2 of 6 (0.65-0.93x, under). With the mixed-precision program's
buffers priced (GELU's tanh kept in float32, the softmax's backward reading the scores:
docs/DESIGN.md), at 3f530c9: bfloat16 3 of 6 (0.93-1.05x without recomputation, 0.87x tp
2 with it at hidden 128); the other recomputed ones stay under (0.67-0.75x). At ff2115a
(2026-12-05, 2 min): float32 6 of 6 (0.94-1.06x), bfloat16 2 of 6 (without recomputation
1.12x / 0.97x at hidden 64 / 128; with it tp 2 0.75x / 0.84x, tp 4 0.73x / 0.71x; tp 2 at
hidden 128 was 0.87x at 3f530c9, priced 7.20 -> 7.40 MiB since, XLA's 8.32 -> 8.82).
The recomputed bf16 ones are not under for XLA's heap packing, as was written here: XLA's
live buffers at its busiest step, summed by their offsets
(`benchmarks/read_buffer_assignment.py`), fill 0.94-0.99 of its temporary allocation.
What they miss is the weight gradients XLA splits into float32 partials (split-K) and
schedules at the end of the backward, holding each layer's MLP operands until then
(docs/DESIGN.md, "A scheduled step's peak"; not priced). At hidden 512 (100-700 MiB
programs; `--hidden 512 --target a100`, 1 min) every one-stage recipe agrees: at 1d02cec
bfloat16 0.92-0.94x, float32 0.87-1.00x; at ff2115a bfloat16 0.93x, 0.98x, 0.91x.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import automap as am  # noqa: E402
from automap._verify import verify  # noqa: E402
from automap._zoo import get_model  # noqa: E402

SIZES = {
    64: dict(seq=64, batch=16, vocab=256, heads=4),
    128: dict(seq=128, batch=8, vocab=512, heads=8),
    # Programs of 100-700 MiB a device, where what XLA holds for its split weight
    # gradients is a small share: with --target a100 only (the CPU compile of its
    # pipelines is slow).
    512: dict(seq=512, batch=16, vocab=2048, heads=16),
}
RECIPES = (
    am.Recipe(tp=2, dp=4, remat="full"),
    am.Recipe(tp=2, dp=4),
    am.Recipe(tp=4, dp=2, remat="full"),
    am.Recipe(tp=2, pp=2, dp=2, remat="full", microbatches=4),
    am.Recipe(tp=2, pp=2, dp=2, microbatches=4),
    am.Recipe(tp=1, pp=4, dp=2, remat="full", microbatches=4),
)


def ratios(hidden: int, dtype: str, recipe: am.Recipe, target: str | None = None) -> list[float]:
    """predicted / XLA: one figure for one stage, one per stage for a pipeline; with
    `target`, compiled for that GPU without one (one-stage recipes only)."""
    spec = get_model("gpt-1.3b", layers=4, hidden=hidden, dtype=dtype, softmax="fused",
                     **SIZES[hidden])  # fmt: skip
    args = spec.abstract_args()
    plan = am.plan_recipe(
        spec.step_fn, *args, recipe=recipe, cluster=am.Cluster.preset("a100", devices=8)
    )
    report = verify(jax.jit(spec.step_fn, donate_argnums=(0, 1)), plan, *args, target=target)
    if plan.pipelined:
        return [p / x for p, x in report.stage_memory_bytes]
    return [report.predicted_memory_bytes / report.xla_memory_bytes]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 128], choices=SIZES)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--target",
        choices=["a100", "h100"],
        help="compile for this GPU without one (the gpu-compile plugin); pipelines skipped",
    )
    opts = parser.parse_args(argv)
    print(f"{'recipe':<34} {'hidden':>6} {'dtype':>8}  predicted / XLA")
    for recipe in RECIPES:
        if opts.target and recipe.pp > 1:
            continue  # a pipeline's programs compile on the CPU only
        name = f"tp {recipe.tp} x pp {recipe.pp} x dp {recipe.dp}, remat {recipe.remat}"
        for hidden in opts.hidden:
            for dtype in opts.dtypes:
                got = ratios(hidden, dtype, recipe, opts.target)
                shown = " / ".join(f"{r:.2f}" for r in got)
                flag = "" if all(abs(r - 1) <= 0.15 for r in got) else "  (outside 15%)"
                print(f"{name:<34} {hidden:>6} {dtype:>8}  {shown}{flag}", flush=True)


if __name__ == "__main__":
    main()
