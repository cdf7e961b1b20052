"""Price one row of Megatron-LM's weak-scaling table with Megatron's own configuration.

    python benchmarks/bench_megatron_row.py            # the 39.1B row
    python benchmarks/bench_megatron_row.py 145.6      # another row of the table
    python benchmarks/bench_megatron_row.py 39.1 --remat

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT, vocabulary 51,200, sequence 2048, A100 80 GB, 8 per
node. The zoo GPT at the row's shapes is captured on abstract shapes (no weights are
allocated) and priced by the pipeline cost model as Megatron runs it: tensor parallel TP
over the node (the `megatron` expert's column/row split on "model"), PP equal stages
(`uniform_cuts`), data parallel over the rest, microbatch size 1 (so global batch / data
microbatches), 1F1B. Prints the predicted step time and the paper's TFLOP/s per GPU:
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) / (step time × GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._expert import DATA, MODEL, _assign, batch_groups, block_groups
from automap._linkage import build_groups
from automap._pipeline._cost import estimate_pipeline
from automap._pipeline._plans import pipeline_plan, uniform_cuts
from automap._zoo import get_model

# params (B): heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
ROWS = {
    "1.7": (24, 2304, 24, 1, 1, 32, 512, 137),
    "3.6": (32, 3072, 30, 2, 1, 64, 512, 138),
    "7.5": (32, 4096, 36, 4, 1, 128, 512, 142),
    "18.4": (48, 6144, 40, 8, 1, 256, 1024, 135),
    "39.1": (64, 8192, 48, 8, 2, 512, 1536, 138),
    "76.1": (80, 10240, 60, 8, 4, 1024, 1792, 140),
    "145.6": (96, 12288, 80, 8, 8, 1536, 2304, 148),
    "310.1": (128, 16384, 96, 8, 16, 1920, 2160, 155),
    "1008": (160, 25600, 128, 8, 64, 3072, 3072, 163),
}
SEQ, VOCAB = 2048, 51200


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The paper's FLOPs per iteration (with activation recomputation)."""
    h, s, l = hidden, seq, layers  # noqa: E741
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row", nargs="?", default="39.1", choices=list(ROWS))
    ap.add_argument("--remat", action="store_true", help="price the plan with remat=True")
    args = ap.parse_args()
    heads, hidden, layers, tp, pp, gpus, batch, published = ROWS[args.row]
    data = gpus // (tp * pp)
    microbatches = batch // data  # microbatch size 1 per data replica

    t0 = time.perf_counter()
    spec = get_model(
        "gpt2-xl",
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=SEQ,
        vocab=VOCAB,
        batch=batch,
        dtype="bfloat16",
    )
    graph = capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(graph)
    cluster = Cluster.preset("a100", devices=gpus)
    model = CostModel(graph, cluster)
    t1 = time.perf_counter()

    mesh = {k: v for k, v in ((DATA, data), (MODEL, tp)) if v > 1}
    assignment = {
        **_assign(batch_groups(groups), DATA, data),
        **_assign(block_groups(groups), MODEL, tp),
    }
    if pp > 1:
        cuts = uniform_cuts(graph, groups, pp)
        plan = pipeline_plan(graph, groups, cuts, mesh, assignment, microbatches, "1f1b")
        plan = dataclasses.replace(plan, remat=args.remat)
        pc = estimate_pipeline(model, plan)
        cost = pc.cost
        extra = {
            "stage (fwd, bwd) ms per microbatch": [
                (round(f * 1e3, 2), round(b * 1e3, 2)) for f, b in pc.stage_times
            ],
            # absent before gradients were reduced once per step (they ran in every B)
            "gradient reduction s per stage": [
                round(e - s, 3) for *_, s, e in getattr(pc, "reduce_ops", ())
            ],
        }
    else:
        cost = model.evaluate(
            assignment, mesh, microbatches=microbatches, remat=args.remat, detail=True
        )
        extra = {}
    t2 = time.perf_counter()

    tflops = paper_flops(batch, SEQ, layers, hidden, VOCAB) / (cost.step_time_s * gpus) / 1e12
    print(
        f"{args.row}B: TP {tp} PP {pp} DP {data}, {gpus} A100s, batch {batch}, "
        f"{microbatches} microbatches of size {batch // microbatches // data}, "
        f"remat={args.remat}"
    )
    print(
        f"  step {cost.step_time_s:.3f} s (compute {cost.compute_s:.3f}, comm {cost.comm_s:.3f},"
        f" bubble {cost.bubble_s:.3f}), memory {cost.memory_bytes / 1e9:.1f} GB per GPU"
    )
    for k, v in extra.items():
        print(f"  {k}: {v}")
    print(f"  TFLOP/s per GPU {tflops:.1f} (published {published}, ratio {tflops / published:.2f})")
    for c in cost.collectives:
        print(f"  {c.kind}@{c.axis}: {c.bytes / 1e9:.2f} GB, {c.count}x, {c.time_s:.3f} s")
    print(f"  capture + tables {t1 - t0:.1f} s, pricing {t2 - t1:.1f} s")


if __name__ == "__main__":
    main()
