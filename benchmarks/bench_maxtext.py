"""MaxText's published TPU v5p table, priced by Auto-MAP, and Auto-MAP's own plans.

MaxText's `configs/v5p/README.md` (32B, 64B and 128B on one v5p slice, `32b.sh`,
`64b.sh`, `128b.sh`): each row priced with MaxText's configuration (ICI fsdp as ZeRO-3 on
the data axis, ICI tensor as tensor parallelism on the model axis with the residual
stream split over it, as MaxText's `activation_embed` rule splits it, and
`remat_policy=minimal` as our "projections") on the slice's torus, and its TFLOP/s per
chip, by MaxText's count (`calculate_tflops_training_per_device`), compared with the
published one; with `--plan SECONDS`, the planner also runs on each row (in a fresh
process: its wall time and peak RSS are its own) and its plan's predicted step time is
set beside MaxText's. The rows and the markdown are `automap._bench`'s (`maxtext_table`,
`maxtext_lines`); the mapping and the count's version are in
`automap/_bench/_maxtext.py`'s docstring.

    python benchmarks/bench_maxtext.py                  # price every row
    python benchmarks/bench_maxtext.py --plan 120       # and plan each row in 120 s
    python benchmarks/bench_maxtext.py --rows 32B --plan 60 --json-out m.json

Planning uses abstract shapes only: no weights are allocated.

`--plan 120` at a5659e5 (2026-12-07; the one-stage walk takes a point's split-stream chain
first): 32B the same plan (6.74 s, 0.95), 64B data 32 x model 2 with the split stream at
6.91 s (0.97), 128B the split stream with selective recomputation at 4.55 s (0.93).
Measured at c59c523 (2026-12-07; flash attention's memory walked moment by moment): the
same 1.01-1.02 and steps; memory 67.5, 72.0 and 47.8 GB (74.0, 75.2 and 49.9 before);
`--plan 120`: 32B and 128B the same plans, 64B the same mesh without the split stream at
7.13 s, 1.00 of MaxText's (the split-stream plan, 6.91 s, is priced as before, but the
walk's work runs out one variant before it: BENCHMARKS.md, "MaxText: the planner on each
row"). Measured at 2e9e4ea (2026-12-05, about a minute; `--plan 120` planned each row in 23-60 s):
1.01-1.02 of the published TFLOP/s per chip (333, 328 and 318; steps 7.08, 7.15 and 4.90
s), since the memory-bound kernels write what XLA stores of their residuals, not every one
the jaxpr saves (a6518b4); the planner's plans as before, each faster than MaxText's
configuration (0.95, 0.97, 0.98). Before it, measured (this script, 2 shared cores, about a minute, on 2026-12-05, each row with
`attention="flash"` as MaxText runs it: every layer's attention core one call to the
Pallas flash kernel, priced by `_cost/_flash.py`): 0.97 of the published TFLOP/s per chip
on every row (318, 313 and 304; steps 7.41, 7.50 and 5.13 s; 74.6, 75.5 and 50.1 GB:
the core's float32 scores and softmax, forward, recompute and backward, gone, the kernel's
matmuls on the 17/32 of the blocks a causal kernel of 16 blocks a side runs; the memory
as before, since `projections` already recomputed the core, whose scores XLA's v5p
schedule does not hold at the step's peak). Before it, with the attention written out and
ZeRO-3's backward gathers priced beside the backward's matmuls (`Lowering.
overlaps_backward_gathers`): 0.86 (281, 278 and 272; steps 8.38, 8.45 and 5.74 s). Before
that (the same day, with the split stream's backward gathers priced beside the backward's matmuls, `Lowering.
overlaps_stream_gathers`): 0.85 of the published TFLOP/s per chip on every row (280, 276
and 269 against 328, 323 and 315; steps 8.41, 8.51 and 5.80 s), each fitting in the
chip's 95 GiB (74.5, 75.4 and 50.1 GB predicted). Before it (2026-12-04, the backward's
second gathers of the split stream priced): 0.81 (266, 263 and 255; 8.84, 8.93, 6.13 s).
Under `projections` the runtime recomputes each layer's norms, whose gathered outputs the
forward then does not keep, so the backward gathers them again (XLA's A100 and v5p
programs: tests/test_seqpar.py); priced since: the 32B row's split-stream gathers went
from 130 (0.49 s) to 194 (0.73 s). At aa1178a, without them: 0.83-0.84 (274, 270 and 263;
8.60, 8.69 and 5.94 s). At 86d773f, before ZeRO-3's forward gathers were priced beside
compute (the runtime compiles TPU programs with XLA's async collective fusion flags,
`_run/_compiler.py`): 0.82-0.83 (272, 267, 259; 8.64, 8.78, 6.03 s). Before the v5p's matmuls ran at the rate XLA's were measured at
(`_cluster.py`: 0.923 of peak, a bf16 8192^3 product on a TPU v5e in JAX's Pallas TPU
matmul guide; the generic 0.6 before): 0.62 (203, 200, 196). Before MaxText's `minimal`
was priced as its own policy and the stream split: 0.61 (199, 196, 191) and none fit
(253, 256, 175 GB; 272, 289, 207 GB before ZeRO-3 gathered layer by layer). What the
memory model was missing, for 32B (per chip, per layer): "selective" kept the norms'
outputs, the SwiGLU product and its sigmoid and the residual stream whole on every
tensor-parallel chip, 7.6 GB a layer; MaxText's `minimal` keeps the layer's input and
the projections' outputs and splits the stream 4 ways, 1.8 GB a layer. The 32B row's
other 10.5 GB of activations (of 68.6) are the head's and the one layer the backward
recomputes at a time, its float32 scores and softmax written out (flash attention holds
none of them; priced so since, the memory kept: see above). With `--rows 32B --plan 120` (at 86d773f, on the 2
cores shared with other work at load 7: 136 s wall, capture included) the planner
returns a one-stage plan that fits and is predicted faster than MaxText's
configuration: FSDP over all 64 chips (ZeRO-3, `projections`) at 7.88 s, 0.91 of
MaxText's 8.64 s (76.2 GB); at 0.6 it was the same plan at 10.82 s, 0.93 of 11.58 s.
At 507c274 (forward gathers hidden) the same plan at 7.75 s, 0.90 of MaxText's 8.60 s,
in 29 s wall; on 2026-12-04 the same plan at 8.03 s, 0.91 of MaxText's 8.84 s, in 32 s
(what moved it from 7.75 s was not bisected). On 2026-12-05 (the split stream's backward
gathers beside compute, which that plan has none of) the same plan at 8.03 s, 0.95 of
MaxText's 8.41 s, in 126 s wall at load 9. With ZeRO-3's backward gathers beside the backward
(2026-12-05, `Lowering.overlaps_backward_gathers`) the same plan at 7.94 s, 0.95 of
MaxText's 8.38 s, in 41 s wall.
The 64B and 128B rows were planned at 5390d0b, at 0.6 (BENCHMARKS.md). Before the
one-stage plans got recomputation and the split stream (`_search/_one_stage.py`: the
ILP's shard space has neither, so it proved that no one-stage plan fits), it returned
pipelines at 1.05, 1.09 and 1.05 times MaxText's step.

Where the 32B step's 8.64 s went (`Cost.per_op`, at 86d773f): the projections' and head's
matmuls 5.47 s; the attention core's two matmuls 0.32 s and its float32 scores, mask and
softmax 0.65 s; the other memory-bound kernels (norms, rotary, the SwiGLU product, the
optimizer update) 1.06 s; collectives 1.15 s (the tensor-parallel all-gathers and
reduce-scatters of the split stream most of it; 1.34 s of the 8.84 s step now, the
backward's second gathers added). Stated, not tuned:

- Collectives are priced serial but for ZeRO-3's gathers (the forward's and the
  backward's second ones) and the split stream's backward gathers (0.50 s of the 32B
  row's 1.39 s off the path, 2026-12-05).
  XLA's TPU compiler at its default flags runs every collective synchronously; with
  the flags MaxText's scripts set (async collective fusion), which `am.apply` now compiles TPU programs
  with, it runs each weight's gather as a chain of fusions beside the matmul that reads
  the weight before it (`_verify/_schedule.py`, docs/DESIGN.md): priced so
  (`Lowering.tpu().overlaps_prefetch`, `_cost/_overlap.py`), which hides 46 ms of the
  32B row's 1.15 s (the data axis' gathers are 0.10 s of it, ZeRO-3 sharding over 16
  chips what tensor parallelism left). The rest is the tensor-parallel all-gathers and
  reduce-scatters of the split stream (0.73 and 0.49 s over the model axis) and
  ZeRO-3's gradient reduce-scatters and backward gathers. Read on v5p (a 4-layer Llama
  at hidden 1024, dp 2 tp 4 and dp 4 tp 2, the runtime's flags; `_cost/_overlap.py`):
  XLA runs every reduce-scatter synchronously (the stream's over the model axis and
  ZeRO-3's gradient reductions over the data axis, combined) and the forward's
  model-axis gathers too; it chains the backward's model-axis gathers (18 of 23) and
  ZeRO-3's backward gathers beside the backward's matmuls, no collective matmul
  decomposition. Both are priced so now (869 of the 1390 us the stream's chains hide
  at the model's rates on that Llama; at 8 heads ZeRO-3's backward chains 131 of 169
  us, `_cost/_overlap.py`). On the 32B row ZeRO-3's data-axis gathers are 0.10 s, 0.08
  of it off the path (0.046 s the forward's, 0.032 the backward's); the split stream's
  model-axis gathers 0.73 s and reduce-scatters 0.49 s, 0.42 s hidden. What stays
  serial is what XLA compiles serial: the reduce-scatters and the forward's gathers
  keep the rows at 0.86.
- Flash attention (MaxText's splash kernel) is not modelled: the zoo's Llama writes the
  attention out, its float32 causal scores and softmax in HBM, and computes the masked
  half of QK^T and PV. Flash attention would keep the scores in on-chip memory and skip
  the masked blocks: up to the 0.65 s of scores and softmax traffic and half the 0.32 s
  of attention matmuls, less the softmax work it does on the vector units: up to 0.81
  s of the 32B row's 8.41 s, which would put it at about 0.94 of published (0.89 when
  every collective was priced serial).
"""

from __future__ import annotations

import sys

from automap._bench import maxtext_lines, maxtext_table, published_table_main, select_maxtext_rows


def main(argv: list[str] | None = None) -> int:
    return published_table_main(
        argv, __doc__.splitlines()[0], select_maxtext_rows, maxtext_table, maxtext_lines, "32B,128B"
    )


if __name__ == "__main__":
    sys.exit(main())
