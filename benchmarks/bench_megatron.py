"""Megatron-LM's published weak-scaling table, priced by Auto-MAP, and Auto-MAP's own plans.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: each row priced with Megatron's own configuration and its
TFLOP/s per GPU compared with the published one; with `--plan SECONDS`, the planner also
runs on each row (in a fresh process: its wall time and peak RSS are its own) and its
plan's predicted step time is set beside Megatron's. The rows and the markdown are
`automap._bench`'s (`megatron_table`, `megatron_lines`): the section `automap bench`
writes into BENCHMARKS.md (`--megatron-plan-s`) is this script's output.

    python benchmarks/bench_megatron.py                 # price every row (about 15 s a row)
    python benchmarks/bench_megatron.py --plan 30       # and plan each row in 30 s
    python benchmarks/bench_megatron.py --rows 1.7,145.6 --plan 600 --json-out m.json

Planning uses abstract shapes only: no weights are allocated.

Memory-bound work is priced by kernel, as XLA fuses it (`_cost/_tables.py`): the causal
mask is regenerated in each fusion, the softmax row sum runs in the kernel that writes
exp(x - max) (GPU multi-output fusion), a producer two kernels need is read by both, and
under full recomputation the first forward writes none of what the recompute makes again.
The one-stage rows moved from 0.78-0.83 to 0.81-0.86 of the published figure with that.
The rows' GPT is the zoo's with Megatron's fused softmax (`softmax="fused"`: the scores,
the probabilities and the probabilities the backward reads are 16-bit, float32 only
inside, where the zoo's default keeps them in float32): every row moved up by 0.01-0.06,
the one-stage rows to 0.83-0.92. The tensor-parallel backward then all-reduced the input
gradient of the separate Q, K and V projections three times where XLA's GPU (compiled
without a GPU, `tests/test_verify_gpu.py`) and Megatron's fused QKV add them first and
all-reduce once (`Lowering.reassociates_all_reduce`): every row moved up by 0.00-0.07,
to 0.86-0.97, the 7.5B row from 0.83 into the 15% band. What still differs from Megatron: XLA runs that softmax
as three kernels (row max; exp and its row sum; normalize) with float32 exponentials
written between them, where Megatron's kernel reads the scores once and writes the
probabilities once; its layer norms, residual adds and GELU are separate
fused kernels rather than Megatron's fused bias-GELU/bias-dropout-add (and it has no
dropout, which Megatron's runs had), and matmuls ran at a flat 0.6 of peak then (the 7.5B
row's matmuls alone, recompute included, took about 2.6 s of the published 3.7 s step). Neither the data-parallel all-reduce nor the
tensor-parallel ones overlap compute, in Megatron-LM of the paper (local DDP) as in XLA
without its latency-hiding scheduler (off by default).

Since full recomputation runs by transformer layer (`_remat/_units.py`) the 7.5B row is
0.83 again (4.44 s a step): the recompute now runs the attention output projection and
its all-reduce once more a layer, as Megatron's does. That is not an over-count: per
layer and sequence the model charges the forward's matmuls (24sh^2(1 + s/6h), 0.893
TFLOP), the backward's (twice that) and the recompute's (0.619 TFLOP: all but the second
MLP matmul, whose output no backward op reads, so XLA drops it, where Megatron's
checkpointed forward runs it), 3.30 TFLOP against the paper's 96sh^2(1 + s/6h) = 3.57
(0.92); the recompute adds one tensor-parallel all-reduce a layer to the four of
forward and backward, where Megatron's adds two.

Since matmuls are priced by shape (`_cost/_gemm.py`: tile quantization under an HBM
roofline, at the A100's published maximum achievable matmul rate, 0.859 of peak, where a
flat 0.6 was) the one-stage rows are 0.99-1.05 of the published figure and the pipelined
ones 1.13-1.17 (39.1B to 1008B: predicted faster). What the pipelined rows still lack is
not known; wave quantization (tiles over whole waves of 108 SMs, on the per-device shape
a plan gives) would take some 4-11% off these rows' GEMM rate and is not modelled; the
memory-bound kernels, priced as XLA fuses them, weigh most on the small rows.
"""

from __future__ import annotations

import sys

from automap._bench import megatron_lines, megatron_table, published_table_main, select_rows


def main(argv: list[str] | None = None) -> int:
    return published_table_main(
        argv, __doc__.splitlines()[0], select_rows, megatron_table, megatron_lines, "1.7,145.6"
    )


if __name__ == "__main__":
    sys.exit(main())
