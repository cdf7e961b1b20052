"""MaxText's published TPU v5p table, priced by Auto-MAP, and Auto-MAP's own plans.

MaxText's `configs/v5p/README.md` (32B, 64B and 128B on one v5p slice, `32b.sh`,
`64b.sh`, `128b.sh`): each row priced with MaxText's configuration (ICI fsdp as ZeRO-3 on
the data axis, ICI tensor as tensor parallelism on the model axis, `remat_policy=minimal`
as our "selective") on the slice's torus, and its TFLOP/s per chip, by MaxText's count
(`calculate_tflops_training_per_device`), compared with the published one; with
`--plan SECONDS`, the planner also runs on each row (in a fresh process: its wall time and
peak RSS are its own) and its plan's predicted step time is set beside MaxText's. The
rows and the markdown are `automap._bench`'s (`maxtext_table`, `maxtext_lines`); the
mapping and the count's version are in `automap/_bench/_maxtext.py`'s docstring.

    python benchmarks/bench_maxtext.py                  # price every row
    python benchmarks/bench_maxtext.py --plan 120       # and plan each row in 120 s
    python benchmarks/bench_maxtext.py --rows 32B --plan 60 --json-out m.json

Planning uses abstract shapes only: no weights are allocated.

Measured (this script, 2 shared cores): every row is predicted at 0.61 of the published
TFLOP/s per chip (200, 197 and 192 against 328, 323 and 315) and none fits in the chip's
95 GiB (272, 289 and 207 GB predicted). With `--plan 120` the planner returned in 72-97 s
a plan that fits for each row, pipelined (4 stages of 1F1B, 32-48 microbatches, data ×
model 8 × 2, 4 × 4 and 4 × 8, recomputation), predicted 1.21-1.25 times MaxText's
configuration's step: slower than a configuration the memory model says cannot run.
Stated, not tuned:

- Matmuls run at the preset's `matmul_efficiency`, 0.6 of the v5p's 459 TFLOP/s (the
  generic figure, not measured on a TPU), where MaxText's published MFU (69-71% of peak
  in counted FLOPs alone) is above it: for 32B the matmuls take about 8.8 s of the
  predicted 11.8 s step, at 0.6 they cap the row at 0.82 of the published figure.
- Flash attention is not modelled: the zoo's Llama writes the attention out, its float32
  causal scores and softmax in HBM, and computes the masked half of QK^T and PV. The
  32B step's memory-bound kernels (that softmax, recomputed too, with the norms, rotary,
  the SwiGLU product and the optimizer update) take the other 1.9 s of its compute.
- Collectives are priced serial (1.1 s of the 32B step, the tensor-parallel all-reduces
  1.0 s of it); MaxText's scripts set XLA's TPU flags for asynchronous collective fusion
  and overlap of compute and collectives.
- Memory: ZeRO-3 gathers whole parameters (float32, a tensor-parallel shard of all of
  them: 31.7 GB of the 32B row's 265 GB of "activations") where MaxText's scan over the
  layers gathers one layer at a time; and the rest, about 7.3 GB a layer for 32B, is
  more than MaxText's `minimal` saves (the seven projections' outputs, about 2.6 GB a
  layer when the embedding dimension is split over `tensor`, as MaxText's
  `activation_embed` rule splits it): the zoo's residual stream is whole on every
  tensor-parallel chip.
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
