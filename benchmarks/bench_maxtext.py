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

Measured (this script, 2 shared cores, about a minute): every row is predicted at 0.62
of the published TFLOP/s per chip (203, 200 and 196 against 328, 323 and 315) and each
fits in the chip's 95 GiB (74.5, 75.4 and 50.1 GB predicted). Before MaxText's `minimal`
was priced as its own policy and the stream split: 0.61 (199, 196, 191) and none fit
(253, 256, 175 GB; 272, 289, 207 GB before ZeRO-3 gathered layer by layer). What the
memory model was missing, for 32B (per chip, per layer): "selective" kept the norms'
outputs, the SwiGLU product and its sigmoid and the residual stream whole on every
tensor-parallel chip, 7.6 GB a layer; MaxText's `minimal` keeps the layer's input and
the projections' outputs and splits the stream 4 ways, 1.8 GB a layer. The 32B row's
other 10.5 GB of activations (of 68.6) are the head's and the one layer the backward
recomputes at a time, its float32 scores and softmax written out (flash attention, not
modelled, would hold none of them). With `--rows R --plan 120`, one row at a time
on the 2 shared cores (busy with other work: wall times of 155 to 490 s, capture and
experts included), the planner returns a one-stage plan that fits and is predicted
faster than MaxText's configuration: 32B, FSDP over all 64 chips (ZeRO-3, `projections`)
at 10.82 s, 0.93 of MaxText's 11.58 s (76.2 GB); 64B, the same at 11.40 s, 0.97 of
11.71 s (77.5 GB); 128B, data 32 × model 4 with the stream split (ZeRO-3,
`projections`) at 7.78 s, 0.98 of 7.98 s (50.7 GB). 28, 15 and 15 one-stage variants
priced. Before the one-stage plans got recomputation and the split stream
(`_search/_one_stage.py`: the ILP's shard space has neither, so it proved that no
one-stage plan fits), it returned pipelines at 1.05, 1.09 and 1.05 times MaxText's step.
Stated, not tuned:

- Matmuls run at the preset's `matmul_efficiency`, 0.6 of the v5p's 459 TFLOP/s (no
  measured TPU matmul rate is published that we found: `_cluster.py`), where MaxText's
  published MFU (69-71% of peak in counted FLOPs alone) is above it: for 32B the matmuls
  take 8.7 s of the predicted 11.6 s step; at 0.6 they cap the row at 0.82 of the
  published figure.
- Flash attention is not modelled: the zoo's Llama writes the attention out, its float32
  causal scores and softmax in HBM, and computes the masked half of QK^T and PV. The
  32B step's memory-bound kernels (that softmax, recomputed too, with the norms, rotary,
  the SwiGLU product and the optimizer update) take the other 1.7 s of its compute.
- Collectives are priced serial (1.1 s of the 32B step, the tensor-parallel
  all-gathers and reduce-scatters of the split stream 1.0 s of it); MaxText's scripts
  set XLA's TPU flags for asynchronous collective fusion and overlap of compute and
  collectives.
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
