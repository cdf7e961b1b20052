"""Lowering: how XLA compiles a training step for one backend, as one object.

The same program costs different bytes on different backends because XLA's pipelines
rewrite it differently: the GPU pipeline turns an all-reduce then sliced into a
reduce-scatter, fuses reductions into their producers' kernels, remakes cheap residuals in
the backward and schedules buffers to die at their last reader; the CPU pipeline does none
of that. Each field below is one such rewrite, found by reading compiled programs (the CPU
HLO, or the buffer assignment of programs compiled for an A100 without one,
`_verify/_gpu.py`): the commit that found it and the test that holds it are named.

The fields move together, one backend at a time: a `Cluster` carries one `Lowering`
(`Lowering.gpu()` on every GPU preset, `Lowering.tpu()` on the TPU ones, `Lowering.cpu()` on
the `cpu` preset), and
verify, which compiles on a CPU mesh, prices a GPU cluster's plan with `Lowering.cpu()`.
Setting one field alone is a what-if (a test that asks what a rule is worth).
"""

from __future__ import annotations

import dataclasses

from ._errors import ClusterError


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What XLA's compiler does to a step on one backend, as the cost model prices it.

    The defaults are XLA's GPU pipeline (`Lowering.gpu()`); `Lowering.cpu()` is its CPU
    one. XLA's TPU pipeline (`Lowering.tpu()`) shares the GPU's collective rewrites
    (reduce-scatter creation, all-reduce folding) and lays its arrays out in tiles.
    """

    collective_float_bytes: int = 0
    """Least bytes per element a floating-point collective moves: XLA's CPU backend runs
    bf16/f16 collectives in f32 (4); GPUs and TPUs move bf16 as is (0: the tensor's own).
    Found in 6ede0f8 (CPU HLO of bert and the MLP in bf16); held by
    tests/test_verify.py::test_zoo_step_in_16_bit_compared_as_the_cpu_moves_it."""
    reduce_scatter: bool = True
    """Whether XLA turns an all-reduce whose result is then split into a reduce-scatter
    (its GPU and TPU pipelines do: ReduceScatterCreator, and AllReduceFolder joins a chain
    of all-reduces into one; the CPU one all-reduces the whole buffer and slices,
    `_cost._kernel.partial_rows`). Found in de1901a; held by tests/test_rules.py
    (test_reduce_scatter_when_the_output_is_split_on_the_reduced_axis) and
    tests/test_cost.py::test_a_reduction_without_reduce_scatter_writes_a_whole_copy."""
    multi_output_fusion: bool = True
    """Whether XLA reduces a tensor inside the kernel that writes it (its GPU pipeline's
    producer-consumer multi-output fusion and Triton softmax fusion; the CPU one, False, runs
    each reduction as its own loop that reads the tensor back: `_cost._fusion.fused_bytes`).
    Time only, never bytes moved or held. Found in 57fb133 (the CPU HLO shows the read);
    held by tests/test_fusion.py
    (test_a_reduction_reads_back_what_its_producer_wrote_only_where_xla_does)."""
    matmul_accumulates: bool = True
    """Whether XLA adds a running sum inside the matmul that makes its addend (its GPU
    pipeline's GEMM rewriter takes a matrix added to a matmul's result as the GEMM's C
    operand); the CPU one, False, writes a pipeline microbatch's weight gradients that a
    matmul makes to buffers of their own, held to the end of its B program, where the
    running sums are added (`_cost._traffic.held_gradients`). Found in 476e55a; held by
    tests/test_verify.py::test_pipeline_memory_holds_the_microbatch_gradients_the_cpu_holds."""
    all_reduce_in_place: bool = True
    """Whether the step's combined gradient all-reduce writes its result over its input
    (XLA's GPU pipeline makes it asynchronous and aliases an all-reduce-start's output with
    its operand), where memory is priced as every activation and gradient alive together
    (`frees_at_last_use` False). XLA's CPU, False, runs it synchronously into a buffer of
    its own, so at the end of the backward the local gradients and their reduced copy are
    both alive (with ZeRO too: the CPU all-reduces and slices). A scheduled step prices
    the reduction's copy itself (`_cost/_model.busiest_moment`). Found in e191666; held by
    test_memory_holds_the_gradients_and_the_copy_the_cpus_all_reduce_writes
    (tests/test_verify.py)."""
    reassociates_all_reduce: bool = True
    """Whether XLA adds partial sums before it all-reduces them: two partial sums that
    would be all-reduced alike and are then added become one all-reduce of their sum
    (`_cost._rows.summed_partials`: the input gradient of separate Q, K, V projections
    under tensor parallelism). XLA's GPU pipeline does (its all-reduce reassociation, read
    on compile-only GPUs, `_verify/_gpu.py`); the CPU one, False, all-reduces each. Found
    in e38d629 (a 2-layer GPT at tp 8 moved 29-40% fewer model-axis bytes than priced);
    held by test_a_gpu_program_keeps_the_residuals_the_gpu_model_prices
    (tests/test_verify_gpu.py)."""
    parallel_iota_lookups: bool = True
    """Whether XLA's gather partitioner reads a lookup at an iota (positions looked up as
    `take(table, arange(seq))`, Hugging Face BERT's) as parallel to the table's rows: with
    the rows split, each device looks up its own positions and all-gathers them (the same
    bytes as a masked lookup's all-reduce; `_cost._rows.iota_lookups`). XLA's GPU pipeline
    does (A100 HLO of HF BERT under Megatron: an all-gather of the lookup's 512 KiB); the
    CPU one, False, masks and all-reduces. Held by
    tests/test_thirdparty.py::test_positions_looked_up_at_an_iota_are_gathered_on_a_gpu."""
    remakes_residuals: bool = True
    """Whether XLA remakes a cheap residual in the backward rather than keep it: a tensor
    the backward reads that an elementwise or layout op makes, and only fusible ops read,
    is fused into each reader and made again from its producer's operands, which are kept
    instead (`_cost.stored_residuals`); so is a softmax (a Triton row fusion), and a 16-bit
    residual read back in float32 is read as its float32 source (excess precision). XLA's
    GPU pipeline does (held against its buffer assignment on compile-only GPUs,
    `_verify/_gpu.py`); the CPU one, False, keeps about every residual of the jaxpr, its
    library fusions taking their operands from memory. Found in 8a671e2 (transformers were
    over-predicted 1.4-2.4x on an A100); held by
    test_a_gpu_program_keeps_the_residuals_the_gpu_model_prices (tests/test_verify_gpu.py)
    and tests/test_residual_memory.py."""
    native_bf16_arithmetic: bool = False
    """Whether XLA's GPU pipeline adds, subtracts and multiplies bfloat16 in bfloat16 (on
    Hopper, sm_90) rather than in float32 (before it: `GpuFloatSupport` normalizes those
    ops to float32 on an A100). It decides how wide a 16-bit transcendental result is
    kept (`_cost._buffers`): on an A100, GELU's bf16 tanh feeds float32 arithmetic, so
    XLA drops its round trip to 16 bits and stores the float32 value for the backward; on
    an H100 the `1 + tanh` that reads it runs in bfloat16 and the stored tanh is 16-bit
    (read on compile-only A100s and H100s, a 2-layer gpt-1.3b: f32[4,2048,8192] against
    bf16; held by tests/test_verify_gpu.py). The h100 and h200 presets set it."""
    float32_norm_buffers: bool = False
    """Whether XLA's GPU pipeline writes the float32 buffers a mixed-precision layer norm's
    forward and backward hold (`_cost/_buffers`): a 16-bit sum that a norm reads back in
    float32, or that sums a value narrowed from float32 for another sum, is kept as its
    float32 value (an A100 adds 16-bit floats in float32, and excess precision drops the
    round trip: a bf16 GPT's residual stream and its cotangent, `_kept_wide_sum`); and
    the operand of a column reduction (a sum over every dim but the minor one: a norm's
    scale gradient) made by elementwise arithmetic is written for a reduction kernel of
    its own (`column_operands`), at the kernel that sums the norm's input gradient into
    the stream's cotangent; a norm's float32 input is kept for its backward
    (`_fusion.statistics_operand`), and the last norm's input gradient is made again
    in float32 in the next norm's kernel (`_buffers._remade_norm_gradients`).
    `Lowering.gpu()` and `hopper()` set it (on Hopper, whose 16-bit sums stay 16-bit, the
    column operands alone, each at its own reduction); found in the buffer assignment of
    compile-only A100s (tests/test_seqpar.py). Off on the TPU: not read there."""
    frees_at_last_use: bool = True
    """Whether a one-stage step's peak memory is the largest sum of the buffers alive at one
    moment (`_cost/_liveness.py`): each freed after its last reader, a gradient no
    collective holds consumed by its update as soon as it is made, the reduced ones held to
    the step's combined reduction, which copies them once more (as a recomputed layer's
    combined all-reduces copy its partial sums at its recompute). XLA's GPU pipeline
    schedules so (its buffer assignment on compile-only GPUs, `_verify/_gpu.py`); the
    CPU's, False, is priced as every activation and every gradient alive together, which
    its buffer assignment agrees with better (its library kernels' own copies). A pipeline
    stage's peak may then be its reduce program (`_cost._traffic.reduce_program`). Found in
    9cade9e; held by tests/test_verify_gpu.py::test_a_gpu_step_peaks_at_one_moment and
    test_a_pipeline_stage_holds_its_reduce_programs_buffers."""
    all_reduce_combine_bytes: float = 30 * 2**20
    """The most bytes XLA's GPU combiner joins into one gradient all-reduce (its default
    `--xla_gpu_all_reduce_combine_threshold_bytes`, 30 MiB): a combined all-reduce copies
    its operands into one buffer (their concatenation) and reduces that, so a scheduled
    step's reduction holds the gradients and at most this much more
    (`_cost/_model.reduction_copy`; read only where `frees_at_last_use`). Found in 3aaff1f;
    held by test_memory_holds_the_gradients_and_the_copy_the_cpus_all_reduce_writes
    (tests/test_verify.py). XLA's TPU joins independent all-reduces up to 120 MiB
    (libtpu 0.0.42.1, v5p: two bf16 partial sums of one input, 60 MiB a chip each, are
    one all-reduce, of 60.5 MiB two), whose elements a loop fusion reading them does not
    write over (`_cost/_apart.py`)."""
    concatenates_combined: bool = True
    """Whether a combined all-reduce first copies its operands into one buffer (XLA's GPU
    combiner reduces their concatenation), so a recomputed layer's partial sums are held
    twice at its recompute (`_buffers.combined_copies`) and the step's combined gradient
    reduction writes a copy beside the gradients (`_peaks.reduction_copy`). XLA's TPU,
    False, writes each result of an all-reduce, combined or lone, over its own operand: in
    libtpu 0.0.42.1's buffer assignments every all-reduce result whose operand is in HBM
    lies at that operand's offset (54 of 54 on a 256-chip bf16 Llama plan that all-reduces
    its recomputed gate and up projections, 768 MiB each, and 73 of 74 over five more
    programs of gpt and Llama on 4 to 256 chips, the one a table's scattered gradient).
    Found where a Llama plan under remat was priced 1.27x XLA's buffers (its recompute's
    partial sums, 1.1 GiB, priced twice); held by tests/test_tpu_memory.py
    (test_a_tpu_reduces_a_recomputed_layers_partial_sums_in_place). Off on the CPU too,
    whose buffers are not scheduled (`frees_at_last_use`): read only where they are."""
    tile_padding: bool = False
    """Whether every array takes whole tiles of the device's memory, its minor two
    dimensions padded to (8, 128) (fewer rows where small; `_cost/_tiles.py`). XLA's TPU
    layouts do; GPU and CPU buffers hold their bytes. Found in ce6da51 on compile-only v5p
    chips (the 64-wide zoo models' state priced at 0.46-0.99x of XLA's arguments, now
    equal); held by tests/test_tiles.py and
    tests/test_verify_tpu.py::test_a_tpu_holds_its_state_in_tiles_as_priced."""
    overlaps_prefetch: bool = False
    """Whether the scheduler runs ZeRO-3's forward gathers beside the forward's compute
    (`_cost/_overlap.py`): each weight's gather (a matrix's, after the first) in flight
    from the previous weight's first reader to its own, the pair costing
    max(gather, compute), not the sum. XLA's TPU does, under the async collective fusion
    flags `am.apply` and verify compile TPU programs with (`_run/_compiler.py`,
    MaxText's): each gather a chain of fusions carried on by the matmul that reads the
    weight before it (libtpu 0.0.42.1, `_verify/_schedule.py`); True on `Lowering.tpu()`.
    Held by tests/test_schedule.py::test_a_tpu_hides_fsdp_gathers_as_the_model_prices.
    XLA's GPU makes each gather an asynchronous pair but schedules about half this
    price's compute inside (0.8% and 3.6% of two FSDP GPTs' steps, where the layer-ahead
    price took off 1.9% and 6.7%; the latency-hiding scheduler alike): its all-gather
    combiner joins two layers' gathers, closing the earlier one's window. False there
    and on the CPU: each collective charged in full, the upper bound. Read on
    compile-only A100s; held by
    tests/test_schedule.py::test_a_gpu_overlaps_an_fsdp_steps_collectives_as_the_model_prices."""
    overlaps_backward_gathers: bool = False
    """Whether the scheduler runs ZeRO-3's second gathers (each matrix gathered again for
    the backward) beside the backward's compute (`_cost/_overlap.backward_windows`): each
    in flight from the backward matmul before its first backward reader to the reader
    (less what makes the reader's backward inputs, which the runtime's gather waits for),
    none where a layer's gradient reduction falls inside, the pair costing
    max(gather, compute). XLA's TPU does under the runtime's async collective fusion flags
    (libtpu 0.0.42.1, v5p 2x2x2, a 4-layer Llama at hidden 1024 under ZeRO-3: each
    layer's backward chains five of its seven matrices' gathers, one matmul each, and runs
    the two its gradient reduction precedes, the down and output projections',
    synchronously); True on `Lowering.tpu()`. Held by
    tests/test_schedule.py::test_a_tpu_hides_fsdp_backward_gathers_as_priced. XLA's GPU
    and CPU: False (each charged in full)."""
    flash_attention: bool = False
    """Whether the runtime runs an attention core as one flash kernel on this backend
    (`Plan.attention == "flash"`, `_run/_flash.py`: Pallas's TPU kernel), so a plan may
    be priced with it (`_cost/_flash.py`) and the one-stage search prices its variants
    with it (`_search/_one_stage.py`). True on `Lowering.tpu()`; the GPUs have no kernel
    in the runtime, and the CPU runs it only in Pallas's interpret mode, for tests."""
    overlaps_stream_gathers: bool = False
    """Whether the scheduler runs sequence parallelism's backward gathers of the split
    stream (the cotangents a matmul reads whole, and the norms' outputs gathered again
    under recomputation) beside the backward's matmuls (`_cost/_overlap.stream_windows`):
    each gather in flight from the backward matmul before its reader to the reader (less
    what makes the gathered tensor), the pair costing max(gather, compute). XLA's TPU
    does under the runtime's async collective fusion flags (libtpu 0.0.42.1, v5p: a
    4-layer Llama at hidden 1024, dp 2, tp 4 chained 18 of the backward's 23 model-axis
    gathers, each beside one to six matmuls, and none of the forward's 9 nor any
    reduce-scatter; at hidden 512 only 3 of 11); True on `Lowering.tpu()`. Held by
    tests/test_schedule.py::test_a_tpu_hides_the_split_streams_backward_gathers_as_priced.
    XLA's GPU and CPU: False (each charged in full)."""
    fuses_matmul_operands: bool = False
    """Whether XLA fuses the elementwise chain that makes a float32 matmul operand into the
    matmul's own kernel (with the convert it runs it in), transcendental functions
    included: then a float32 residual that matmuls and fusible ops read, made by
    elementwise or layout ops (GELU's output and its tanh, a layer norm's output,
    softmax's probabilities), is made again inside each backward reader from its operands
    (`_cost._residuals`; not a recomputed layer's, whose recompute writes them), and its
    forward buffer dies at its last forward reader (`_cost._buffers`). XLA's TPU does (its convolution fusions take their operands'
    producers; libtpu 0.0.42.1, v5p: a float32 2-layer GPT's buffers alive at its peak
    hold no tanh, GELU output, layer-norm output or probabilities; a bfloat16 Llama's
    keep its SwiGLU product and bf16 probabilities, so 16-bit residuals matmuls read are
    not made again). A 16-bit transcendental result only fusible ops read is, as on the
    CPU and GPU a cheap one is: a bf16 Llama's SwiGLU sigmoid is made again from the
    stored gate output in the backward's kernel (`_cost._residuals._remade_from`; held by
    tests/test_tpu_memory.py). Its GPU pipeline calls cuBLAS, which reads its operands
    from memory (False)."""
    holds_split_operands: bool = False
    """With `fuses_matmul_operands`: whether a weight-gradient dot XLA splits beside ZeRO's
    data axis (`_cost/_beside.py`) reads a float32 operand an elementwise chain makes (a
    layer norm's output, GELU's) from a buffer the forward writes, at the width the matmul
    reads it (bf16), rather than making it again inside the dot: the dot runs on a slice
    of it, into which XLA does not fuse the chain (`_cost._buffers.split_operands`, priced
    without remat). XLA's TPU does (libtpu 0.0.42.1, v5p 4x8x8: gpt plan 6 of the TPU
    bench, data 16 x model 16 under ZeRO-2, held each whole layer's two norm outputs as
    bf16 [32, 128, 512] and its GELU output as bf16 [32, 128, 2048] for the dots' [512, 32]
    pieces: 72 MiB the model left out, 0.83x XLA's buffers; 0.96x with them). Held by
    tests/test_verify_tpu.py."""
    late_split_dots: bool = False
    """With `holds_split_operands`: whether, in a pipeline stage's B program that reduces
    the gradients it makes (one microbatch), the weight-gradient dots XLA splits beside
    ZeRO's data axis run at the program's end, so what they read is alive to there
    (`_cost._traffic.temporaries`). XLA's TPU defers one of them in every B program read
    (libtpu 0.0.42.1): a float32 GPT's first MLP weight gradient, run after the layer's
    attention backward, its two float32 operands (made with the hidden's gradient) held
    from the MLP's backward to it. On v5p 4x8x8, stage 0 of gpt's GPipe plan 3 of the TPU
    bench (data 8 x model 8, ZeRO-1, full recomputation) holds the two f32 [64, 128,
    2048] over steps 155-275 of 381, even with its HBM held to 400 MiB; a 2-stage GPT on
    v5p 2x2x2 holds them so at 16, 32 and 64 sequences a device. XLA runs the attention's
    split dots and the second MLP matmul's in order; the model defers every split dot,
    which over-prices where their operands weigh: that GPT's stage 1 at 1.19x, 1.13x,
    1.00x of XLA's (0.97x, 0.88x, 0.76x without). Why XLA defers that one is not read.
    Llama's bf16 gradients, reduced whole, are not split. Held by
    tests/test_verify_tpu.py (64 sequences a device)."""
    fuses_matmul_epilogues: bool = False
    """Whether a matmul whose output only elementwise ops read runs them in its own kernel
    and never writes that output, where no mesh axis splits its contraction
    (`_cost._epilogue.py`). XLA's TPU does (libtpu 0.0.42.1: the kernel of the backward
    matmul that makes an MLP's hidden gradient makes GELU's derivative times it, and the
    bias gradient's sum); its GPU pipeline calls cuBLAS, which writes every output
    (False)."""
    matmul_operand_bytes: int = 0
    """Bytes per element a float32 matmul reads its operands in at the default precision,
    where not 0: a float32 residual kept only for matmuls (every tensor it stands in for
    is read by default-precision matmuls alone) is stored converted, at this width
    (`_cost._buffers`). XLA's TPU runs such matmuls in one bfloat16 pass (2) and writes
    the convert in the producer's kernel (libtpu 0.0.42.1, v5p: a float32 GPT's attention
    keeps its q, k, v and context as bf16 [32, 128, 512]); so is a float32 partial sum
    only such matmuls read all-reduced, as their bf16 operand (`_cost._rows.narrow_partials`:
    a GPT's context gradient with its hidden dim split); 0: as the tensor (GPUs, CPUs)."""
    fused_row_elements: int = 0
    """Where not 0, the longest row whose reduction XLA runs inside the matmul kernel that
    makes it (a softmax's max over the last axis of a matmul's output) when the matmul
    contracts more than `fused_row_contraction` elements: the shift of a longer row (the
    output less its row max) is written by a kernel of its own and kept for the backward
    in the output's place, both alive as it is made (`_cost._residuals`). XLA's TPU: 1024
    (libtpu 0.0.42.1, v5p: the log-softmax of a float32 [r, n] = [b, 128, K] @ [K, n]
    holds 2x the logits in temporaries for n from 2048, r from 2048 and K 512 or 1024,
    1x for n = 1024 or K up to 256; a 2-layer GPT's f32 [32, 128, 4096] logits, K = 512,
    and their shift were both alive at its peak, with K = 256 one kernel made both); 0:
    never apart (the cost model's GPU and CPU rules store the exp instead). Rows within
    it, a recomputed softmax's exp is written by the kernel of the matmul that makes its
    scores and stored at its width, the scores never written (`_cost._residuals.
    _row_kernel_exp`: a bf16 Llama's f32 exp, read on v5p)."""
    fused_row_contraction: int = 0
    """With `fused_row_elements`: the longest contraction whose matmul XLA fuses into the
    kernel of its output's softmax shift, however long the row (XLA's TPU: 256)."""
    apart_row_elements: int = 0
    """With `fused_row_elements`, where not 0: the longest row whose shift XLA still
    writes apart; a longer one it makes again inside each kernel that reads it, as it
    does a short one. XLA's TPU: 8192 (libtpu 0.0.42.1, v5p, the float32 log-softmax
    loss of [r, K] @ [K, n] logits a chip, K = 512: 2x the logits in temporaries for n
    from 4096 to 8192, 1x for n = 8704 to 50304, a real vocabulary; a 2048-wide GPT's
    [512, 1024, 32000] logits on a v5p chip are one buffer, not two)."""
    apart_row_contraction: int = 0
    """With `apart_row_elements`: the longest contraction whose matmul's shift XLA writes
    apart (XLA's TPU: 1024; with K = 2048 or 3072 the shift of rows of 2048 to 32000 is
    made again inside its readers, 1x the logits)."""
    scatter_least_elements: int = 0
    """Where not 0, XLA reduce-scatters a ZeRO gradient only where its shard is large
    enough for the group, else it all-reduces it whole and slices (`_cost._tiles.
    tpu_zero_scatter`): a shard of at least this many elements per torus dimension the
    data axis' group spans, of rank 2 or more, at least 128 lanes and 16 rows in its minor
    two dimensions, over a group spanning fewer than three torus dimensions. XLA's TPU
    compiler decides so (libtpu 0.0.42.1, `x.sum(0)` of a data-sharded f32 or bf16
    [2n, R, C] pinned to P("d"), v5p 2x2x1, 2x2x2, 4x4x4: one torus dimension from
    [16, 128] a shard, two from [32, 128] or [16, 256], never [8, 512] on 2x2x2, 1-D arrays, nor
    the whole 2x2x2 cube up to f32[8192, 1024]). Where every torus dimension the group
    spans is a ring of 4 chips or more, a shard of 16 rows, or of 8 and this many
    elements, whatever the dimensions and lanes (4x4x4: f32 [8, 512], bf16 [16, 64] and
    [8, 256] scattered, [8, 128] not; 4x4x1 at data 8 x model 2 alike); nor a 2-D gradient whose split lies on
    the lanes of the buffer its dot (or lookup) writes, laid as it pads least
    (`_cost._scatter`: a Llama's transposed [out, hidden] weight gradients at data 4 x
    model 2 on 2x2x2); 0: every ZeRO gradient is reduce-scattered (GPUs: the same Llama
    compiled for A100s reduce-scatters all 4.6 MiB). docs/DESIGN.md, "TPU slices"; held by
    tests/test_verify_tpu.py::test_a_tpu_all_reduces_whole_the_zero_gradients_it_keeps_whole."""
    recompute_gathers_casts: bool = False
    """Whether ZeRO-3's gather for a recompute under remat moves the narrow cast the step
    reads (as the forward's does: `_cost._zero.gathered_bytes`), not the parameter: XLA's
    TPU moves the convert across the recompute's optimization barrier (libtpu 0.0.42.1,
    v5p 2x2x2: a bfloat16 2-layer Llama over float32 parameters, data 8, ZeRO-3 and full
    remat, gathers bf16 weights forward and backward, 7.0 MiB, where the recompute's gathers
    priced float32 made 9.5; Llama on 4x4x4, data 8 x model 8: 38.4 MiB, priced 51.5 as
    float32). XLA's GPU pipeline, False, gathers the float32 parameters through the
    barrier (the same step compiled for A100s: 9.26 MiB; `_cost._fsdp.gather_coefs`).
    Held by tests/test_verify_tpu.py::test_a_tpu_gathers_the_casts_a_recompute_reads."""
    gather_all_reduced_from: int = 0
    """Where not 0, an all-gather whose group is every chip of a one-slice torus of at
    least this many chips runs as an all-reduce of the gathered buffer (each chip adds its
    shard into zeros): the same bytes, an all-reduce's time (`_cost._kernel.totals`).
    XLA's TPU compiler does so (libtpu 0.0.42.1, a data-sharded f32 or bf16 [n, C]
    gathered whole, C from 128 to 262144: an all-reduce on v5p 4x4x4, 2x4x8, 4x4x6,
    4x4x8, 4x8x8, v5e and v6e 8x8; an all-gather on v5p 2x2x2, 2x2x4, 2x4x4, v5e 4x8, and
    over 64 of 4x4x8's 128 chips): 64 on `Lowering.tpu()`. Held by
    tests/test_verify_tpu.py::test_a_tpu_gathers_over_a_whole_slice_as_an_all_reduce."""

    major_dim_collectives: bool = False
    """Whether an all-gather or reduce-scatter runs on its buffer's major dim alone, so a
    split on another dim (a batch-major [b, s, h] stream split on its sequence,
    `Plan.sequence_parallel`) is laid out sequence-major around the collective and
    transposed between that layout and its matmuls' (`_cost/_seqpar.py`, `layout_rate`).
    XLA's A100 pipeline does: a 2-layer bf16 GPT at the 22B width, microbatch 4, tp 8
    transposes each gathered copy (once, twice where a weight gradient reads it as its
    left operand) and each reduce-scattered buffer, 22 kernels of 201 MB, 2.1 GB a layer
    per device (an H100's, the same 22); a microbatch of 1 is sequence-major already. True
    on `Lowering.gpu()` and `Lowering.hopper()`. Held by tests/test_fusion.py
    (test_a_sequence_parallel_streams_kernels_move_what_xlas_a100_fusions_move)."""

    early_recompute: bool = False
    """Whether, under full recomputation, a layer's recompute runs before the kernels
    that lie between the backward's last matmul and the layer's first backward read (the
    next layer's norm backward, which reads that layer's all-reduced cotangent), so its
    residuals are alive there too (`_cost/_buffers._recompute_moment`). XLA's A100
    pipeline schedules it so (read in the buffer assignment of a 2-layer bf16 GPT at tp 8:
    its peak, layer 2's first norm's backward kernel, after layer 1's recompute and its
    all-reduces). Compiled for 8 A100s, full recomputation, the memory priced against
    XLA's buffer assignment: 2 layers at tp 8 0.88x without it, 1.035x with it; 4 layers
    at tp 8 0.94x, 0.98x; 3 layers at tp 4 x dp 2 0.87x, 0.94x; at dp 8, tp 2 x dp 4 and
    dp 8 with ZeRO-1 the peak lies elsewhere: the same price. True on `Lowering.gpu()` and
    `Lowering.hopper()`. Held by tests/test_seqpar.py
    (test_on_a_gpu_the_split_saves_what_xlas_buffer_assignment_saves) and
    tests/test_verify_gpu.py (3 layers at tp 4 x dp 2)."""

    # ---- presets ----------------------------------------------------------------------

    @classmethod
    def gpu(cls) -> Lowering:
        """XLA's GPU pipeline (the v100 and a100 presets; Hopper's is `hopper()`)."""
        return cls(float32_norm_buffers=True, major_dim_collectives=True, early_recompute=True)

    @classmethod
    def hopper(cls) -> Lowering:
        """XLA's GPU pipeline on Hopper GPUs (the h100 and h200 presets): bfloat16 adds,
        subtracts and multiplies run in bfloat16 (`native_bf16_arithmetic`)."""
        return cls(
            native_bf16_arithmetic=True,
            float32_norm_buffers=True,
            major_dim_collectives=True,
            early_recompute=True,
        )

    @classmethod
    def tpu(cls) -> Lowering:
        """XLA's TPU pipeline (every TPU preset): the GPU's collective rewrites, its
        arrays laid out in tiles, ZeRO-3's gathers beside the forward's matmuls (under
        the flags the runtime compiles TPU programs with, `_run/_compiler.py`)."""
        return cls(
            tile_padding=True,
            concatenates_combined=False,
            all_reduce_combine_bytes=120 * 2**20,
            scatter_least_elements=2048,
            overlaps_prefetch=True,
            overlaps_backward_gathers=True,
            overlaps_stream_gathers=True,
            flash_attention=True,
            gather_all_reduced_from=64,
            recompute_gathers_casts=True,
            fuses_matmul_operands=True,
            holds_split_operands=True,
            late_split_dots=True,
            fuses_matmul_epilogues=True,
            matmul_operand_bytes=2,
            fused_row_elements=1024,
            fused_row_contraction=256,
            apart_row_elements=8192,
            apart_row_contraction=1024,
        )

    @classmethod
    def cpu(cls) -> Lowering:
        """XLA's CPU pipeline: the `cpu` preset, and verify's pricing of what it compiles
        on a CPU mesh."""
        return cls(
            collective_float_bytes=4,
            reduce_scatter=False,
            multi_output_fusion=False,
            matmul_accumulates=False,
            all_reduce_in_place=False,
            concatenates_combined=False,
            reassociates_all_reduce=False,
            parallel_iota_lookups=False,
            remakes_residuals=False,
            frees_at_last_use=False,
        )

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(_NAMED)

    @classmethod
    def preset(cls, name: str) -> Lowering:
        """The lowering named `name` ("gpu", "hopper", "tpu", "cpu"), as a cluster file's `lowering:` names it."""
        key = str(name).lower()
        if key not in _NAMED:
            raise ClusterError(
                f"unknown lowering {name!r}; choose one of {', '.join(_NAMED)}, or give a "
                "mapping of its fields (lowering: {reduce_scatter: false, ...})."
            )
        return _NAMED[key]()

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(Lowering))

    @staticmethod
    def switches() -> tuple[str, ...]:
        """The fields that are true or false (the rest are numbers)."""
        return tuple(f.name for f in dataclasses.fields(Lowering) if f.type == "bool")


_NAMED = {
    "gpu": Lowering.gpu,
    "hopper": Lowering.hopper,
    "tpu": Lowering.tpu,
    "cpu": Lowering.cpu,
}
