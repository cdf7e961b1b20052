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
ones 1.13-1.17 (39.1B to 1008B: predicted faster). Three mechanisms were measured against
that gap (`bench_breakdown.py sc21:39.1 sc21:1008 waves`); none closes it:
- wave quantization (not priced: it depends on the per-device shape a plan gives): a
  layer's GEMMs at microbatch 1 keep 0.82-0.89 of their rate on the one-stage rows and
  0.88-0.97 on the pipelined ones in 256 x 128 tiles over 108 SMs (128 x 128: 0.91-0.95
  and 0.94-0.98). It would slow the rows that fit more than those that do not.
- the sends between stages: this runtime's are `device_put`s dispatched asynchronously
  (`_run/_pipelined.py`), priced as the receiver's lag (`_cost/_pipelined.py`), 7.9 ms a
  cut on 1008B (each device sends the whole replicated activation: no scatter/gather).
  Megatron's are synchronous, but with its scatter/gather (SC'21 sec. 4.1) two of about
  1 ms a microbatch would add about 1% to the 152 ms of 1008B's slowest stage.
- the data-parallel all-reduce: a ring over the nodes at 25 GB/s per GPU (a node's eight
  200 Gb/s HCAs shared by its eight GPUs), x0.8: 0.48 s of 39.1B's 12.8 s step, 0.36 s of
  1008B's 88 s; the 18.4B row, which fits, reduces as many bytes per GPU (0.46 s).
The published tables disagree instead: Korthikanti et al. (`bench_korthikanti.py`) ran
the 1T model on the same Selene A100s in the 1008B row's configuration (TP 8, PP 64,
microbatch 1, full recomputation, 1F1B, 512 microbatches a pipeline; only DP 6 differs)
at 177 TFLOP/s per GPU by this count, where this table has 163; their 175B (PP 8,
interleaved in 3) at 162 against 145.6B's 148; their one-stage 22B (h 6144, TP 8) at 134
against 18.4B's 135. The two agree on one stage and differ by 9-10% on pipelines, so one
model of both, which prices 1T at 0.93 of Korthikanti's time (87.7 s), is 1.17 on the
SC'21 row (88.1 s); both bands (15%, 10%) hold only for a step of 89.2-103.9 s there
(published 102.6 and 94.4).

Since the rows' GPT clips its gradients to a global norm of 1.0 before Adam, as Megatron-LM
does (`--clip-grad` 1.0; measured at 6f34526, prices only), XLA's clip (the norm's sums of
squares fused into the kernels that widen the gradients, one combined all-reduce of
scalars, the scale fused into Adam) moved each step by at most 0.03 s and each ratio by at
most 0.01: the one-stage rows 0.99-1.04, the pipelined ones 1.12-1.17. Megatron's own
optimizer runs the norm, the clip's scale, the copy of the float32 parameters to 16-bit
ones and the zeroed gradient buffer as separate passes that XLA fuses or has no need of:
not priced (docs/DESIGN.md, Rematerialization).
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
