"""Memory and FLOPs fidelity: the cost model's peak memory and FLOPs per device against
what XLA compiles, on random plans.

For each model, draw random plans of the shard space (a random mesh factorization of 8
devices, a random mesh axis or none for every splittable linkage group, a random ZeRO
stage 0-3 where the space offers one: with the batch on the data axis) with
rematerialization on or off at random; a random point rarely puts the batch on data, so
with `--zero Z` a share Z of the one-stage plans is drawn again until it has ZeRO 1-3.
With `--pipelines P`, a fraction P of the plans are pipelines instead (2 or 4 stages cut
at uniform FLOPs, 1, 2 or 4 microbatches, GPipe or 1F1B, the stage mesh's batch on
"data" and the rest random as above). Each plan is compiled by XLA on 8 virtual CPU
devices (`automap._verify.verify`), and two numbers are held against XLA's:

- memory: the cost model's peak per device against XLA's buffer assignment (arguments +
  outputs + temporaries - aliased; a pipeline's busiest stage combined from its programs,
  `automap._verify._stages`);
- FLOPs: the cost model's per device, counted as XLA counts (`automap._verify._flops`:
  loop bodies once, no padded convolution taps), against `cost_analysis()`.

Prints one line per plan and the fraction of plans within 15% (|predicted / XLA - 1| <=
0.15), per model and overall, and the worst disagreements.

    python benchmarks/bench_memory.py                    # 12 plans per model, every model
    python benchmarks/bench_memory.py --plans 4 --models gpt flax_lm --pipelines 0.25

With `--target a100` (or h100) each one-stage plan is compiled instead by XLA's GPU
compiler for that GPU without one (`automap._verify._gpu`, the `gpu-compile` extra), and
the cost model prices it as on that GPU's preset: what a user of the GPU plans is told,
against what the GPU program would hold; a pipeline's programs are compiled for it stage
by stage (the same draw as on the CPU, so the two runs compare plan by plan). XLA's GPU
compiler reports no FLOPs.

    python benchmarks/bench_memory.py --plans 8 --zero 0 --target a100   # 41 plans, 3 min

Against the GPU, one-stage memory is priced as the busiest moment of the scheduled step
(`Lowering.frees_at_last_use`, `automap._cost._liveness`, docs/DESIGN.md): at 5aa2397
(seed 0; 2.5-4 min each), `--plans 8` 36 of 39 within 15% (92%: mlp 6 of 6, bert 7 of 8,
gpt 5 of 6, vgg19 5 of 5, flax_lm 6 of 7, eqx_mlp 7 of 7; ZeRO 10 of 10, remat 23 of 26),
`--plans 8 --zero 0` 35 of 41 (85%), the default 12 a model 50 of 57 (88%). Before it
(every activation and gradient alive together) the same draws gave 27 of 39 and 26 of
41. With a recomputed layer's combined all-reduces priced (XLA's combiner joins its
activation all-reduces with the backward's and copies their operands into one buffer at
the recompute: `_cost._tables.combined_copies`), at 3f530c9: `--plans 8` 38 of 39 (97%;
remat 25 of 26), `--zero 0` 41 of 41, the default 54 of 57 (95%): the transformer remat
plans that were 0.78-0.84x are 0.98-1.03x. With pipelines compiled for the GPU too (a
stage's reduce program writes its result and its combined all-reduce's copy beside the
running sums it reads: `_cost._traffic.reduce_program`), at ef413c4: `--plans 8` 47 of 48
(98%): pipelines 9 of 9 (0.93-1.04x; 0.75-0.81x on mlp and vgg19 before that program's
buffers were priced), ZeRO 16 of 16, remat 30 of 31. Left: one replicated-batch bert under remat
1.23x (XLA's backward holds less of the recomputed layer than the block priced), a bert
ZeRO-2 remat plan 1.17x, and a vgg19 ZeRO-3 plan 0.72x (XLA gathers every kernel of the
backward early and keeps each, copied to cuDNN's layout, to the end of the backward). At ff2115a
(2026-12-05, 5 min on two loaded cores) `--plans 8` is 48 of 48 (0.87-1.14x), a draw
without those three plans (the space has moved); collectives 40 of 48 (flax_lm 2 of 8:
its all-reduces over data+model priced 1.25 MiB against XLA's 768 KiB on plan 0).

With `--target v5p:2x2x2` (or another TPU topology of 8 devices) the plans are compiled by
XLA's TPU compiler through libtpu (`automap._verify._tpu`, the `tpu-compile` extra), priced
on the tpu-v5p preset on that slice. At c056793 (seed 0, `--plans 4 --models mlp gpt
bert`, 4 min) memory was within 15% on 0 of 12 plans (0.08-0.47x); with arrays priced in
XLA's TPU tiles (`automap._cost._tiles`, ce6da51) the priced parameters, optimizer state
and batch equal XLA's arguments on all 12, and what is left on plans this small is not
arrays: each tuple value gets a 16 KiB slot of XLA's TPU temp allocation, which
`temp_size_in_bytes` counts about twice (docs/DESIGN.md, "TPU slices"). The 64-chip
slice's fidelity, collectives included, is `bench_tpu_fidelity.py`'s; at 256 wide
(tests/test_verify_tpu.py) tensor, data and ZeRO-1 plans and a pipeline match.

Models: the zoo (mlp, bert, gpt, vgg19, as in bench_fidelity.py, float32) and two
third-party families written as their users write them: a Flax (linen) transformer
language model trained with optax's Adam ("flax_lm"), and an Equinox MLP classifier
with optax's Adam ("eqx_mlp"). Nothing is downloaded.

Measured at e191666 (jax 0.10.2 CPU; seed 0, 25% pipelines; about 2.5 min each):

| draw                  | plans | memory ±15%                                    | FLOPs ±15% |
|-----------------------|------:|------------------------------------------------|-----------:|
| `--plans 8`           | 48    | 29 (60%): ZeRO 10 of 16, pipelines 8 of 9      | 48 (100%)  |
| `--plans 8 --zero 0`  | 48    | 32 (67%): ZeRO 6 of 7, pipelines 7 of 7        | 47 (98%)   |
| (default, 12 a model) | 72    | 42 (58%): ZeRO 17 of 28, pipelines 13 of 15    | 72 (100%)  |

Per model (`--zero 0`, the draw of the earlier figures): mlp 8, bert 6, gpt 5, vgg19 2,
flax_lm 3, eqx_mlp 8 of 8; with ZeRO drawn (`--plans 8`): 8, 3, 3, 4, 3, 8. At 645f9af
the `--zero 0` draw gave 28 of 48 (mlp 7, vgg19 0, eqx_mlp 7): e191666 added the CPU's
second one-stage peak, the gradients' all-reduce writing a copy of its own beside them
(`Lowering.all_reduce_in_place`), which is all of XLA's temporaries on data-parallel
MLPs (mlp's data 2 x model 4 plan 0.81 -> 1.00x, eqx_mlp's ZeRO-3 0.67 -> 1.00x, vgg19's
data=8 plans 0.82 -> 0.95x). The pipelines' stage memory is priced as the runtime holds
it (one gradient buffer, the backward's and the update's own buffers by liveness, and on
the CPU each microbatch's weight gradients held to the end of its B program). What is
left: one-stage transformers over-predicted (bert, gpt 1.15-1.36x, flax_lm 1.19-1.60x,
most with remat), convolutions under (vgg19 0.46-0.76x), and a replicated bert with remat
under (0.64x: four FFN-sized buffers of the recomputed layer's backward at once, and the
CPU's materialized broadcasts of the attention mask and the layer norms' scales, held from
the forward to the backward). FLOPs: the one miss without ZeRO drawn is vgg19's ZeRO-2
with remat (1.17x). At 858d8e4, when the space still offered ZeRO with the batch off the
data axis (44 one-stage and 4 pipelines, 30 with ZeRO), this command gave FLOPs on 40 of
48 and memory on 17 of 48; the bullets below that name ZeRO plans with the batch off
data are from that draw.

The Megatron table's configurations on reduced GPTs (`am.plan_recipe` with the fused
softmax, 4 layers, hidden 64 and 128, batch 16 and 8, bf16 and float32, `am.verify` of
the step jitted with its state donated), predicted / XLA; one stage measured at f2667b0,
pipelines (stage 0 / stage 1, 4 microbatches) at 476e55a:

| recipe                          | hidden 64 bf16 | f32  | hidden 128 bf16 | f32  |
|---------------------------------|---------------:|-----:|----------------:|-----:|
| tp 2 x dp 4, full recomputation |           0.94 | 1.09 |            0.97 | 1.11 |
| tp 2 x dp 4, none               |           0.89 | 1.26 |            0.89 | 1.23 |
| tp 4 x dp 2, full recomputation |           0.81 | 0.96 |            0.85 | 0.99 |
| tp 2 x pp 2 x dp 2, full        |    0.88 / 0.94 | 0.93 / 1.09 | 0.85 / 0.91 | 0.89 / 1.02 |
| tp 2 x pp 2 x dp 2, none        |    0.83 / 0.80 | 0.95 / 1.01 | 0.81 / 0.79 | 0.96 / 1.03 |
| tp 1 x pp 4 x dp 2, full        | 0.75-0.88 | 0.93-1.06 | 0.75-0.87 | 0.87-1.00 |

(`python benchmarks/bench_recipe_memory.py` prints this table.) Every float32 pipeline
and float32 recipe with recomputation is within 15%; one stage without recomputation is
over-predicted (1.23-1.26x). The pipelines' first stage was 0.79-0.84x before
476e55a: XLA's CPU B program writes each weight gradient a matmul makes to a buffer of
its own and adds the running sums at its end (0.64 MiB of stage 0's 1.91 MiB
temporaries, hidden 128), and the stage model now holds them there
(`_cost._traffic.held_gradients`; a GPU's GEMM rewriter folds that add into the matmul,
`Lowering.matmul_accumulates`). What stage 0 still misses there: five score-sized float32
buffers of the attention's backward at once (the softmax backward's products, and a
causal-mask broadcast the CPU materializes in the recompute and holds), 1.25 MiB, where
the model's liveness finds two or three.

The bfloat16 recipes stay 0.75-0.97x. XLA's CPU runs a bf16 matmul in float32 (the bf16
GPT's buffer assignment has a float32 convert of every bf16 weight), which likely makes
most of its F and B programs' temporaries (2.1 and 3.2 MiB on tp 1 x pp 4); not checked
buffer by buffer.

A third memory model was measured and not built: the pipeline stages' model
(`_cost._traffic.stage_memory`: the residuals, the backward's and the update's own
buffers by liveness) applied to the one-stage program as a one-stage partition, with
XLA's stored set (`stored_residuals`) in place of the jaxpr's, and under remat the
recomputed layers' stored set. At 50d0011 it brought memory to 32 of 48 from 28 (vgg19 7
of 8, 0.84-1.08x: the backward's own buffers were the missing part; bert 6 of 6); at
e191666, with the all-reduce's second peak in both, it gives 27 of 48 against the linear
tables' 32: it over-predicts the MLPs (1.07-1.21x; not the residual set: on one device
XLA stores for a ReLU what `stored_residuals` names, the matmul output and the max, and
remakes the mask) and flax_lm with remat (1.21-1.32x), and under-predicts gpt (0.79-0.85x,
the attention backward's score-sized buffers). It is a liveness walk per plan, not a
linear table; its peak moves with the layout (one linear row, the live set where the
unsharded program peaks, gives 26 of 48), so it would need one row per candidate peak
point, `evaluate` their maximum and the ILP one memory constraint per row, which the
solvers now take (`FactorProblem.memory_factors`, and `leanest_problem` minimizes their
peak), at the price of a larger MILP. Pricing only the largest recomputed layer with the
stored set (the recompute and its backward are one program) gives 35 of 48 at e191666,
but under-predicts four remat plans (0.73-0.84x), so it is not kept.

What the numbers say of the one-stage plans:

- XLA's figure is an allocation, not a live set: the bytes its CPU buffer assignment
  packs the program into (what `memory_analysis()` reports) exceed the bytes alive at
  its own peak by 0-60% (from `--xla_dump_to` with `--xla_dump_hlo_as_text`: the
  `*-memory-usage-report.txt` total against the `*-live-range.txt` peak, the `--zero 0`
  one-stage plans at e191666): transformers 1.00-1.18, vgg19 1.04-1.42, flax_lm with
  remat 1.17-1.60. A liveness model, however exact, misses those plans by the packing.
  Against the live peak the disagreements below stay (transformers over, bert and gpt
  1.13-1.33x; vgg19 under, 0.57-0.79x on its model-axis plans);

- the stored state agrees: on every one-stage plan, the cost model's parameters +
  optimizer state + inputs (ZeRO's shards included) equal XLA's arguments within 0.5%;
  every memory disagreement is in the dynamic part, XLA's temporaries against the cost
  model's gradients + activations;
- transformers (bert, gpt, flax_lm) are over-predicted (1.2-1.6x): the activations kept
  for backward are counted as the jaxpr's residuals, many of them elementwise
  intermediates (GELU's chain, LayerNorm's centred input, the tanh derivative JAX's
  linearization makes in the forward) that XLA fuses into the backward and recomputes
  rather than stores. No simple rule reproduces XLA's choice: on the six transformer
  plans without remat, keeping only fusion roots (matmul and reduction outputs, inputs)
  predicts 0.44-0.57x, roots plus expensive elementwise results (exp, div, tanh...)
  0.66-0.80x, the jaxpr's residuals 1.19-1.43x. Gradients and activations are also
  summed where their lifetimes only partly overlap;
- convolutions (vgg19) are under-predicted (0.46-0.76x, where the all-reduce's copy is
  not the peak): XLA's temporaries are 1.7-3x the predicted gradients + activations. The
  CPU's gradient all-reduce writing a buffer of its own beside its input (2x the
  gradients on data=8) is priced since e191666; for the rest, the bullet on vgg19's
  misses on one device below;
- which residuals XLA stores (`_cost.stored_residuals`, tests/test_residual_memory.py): a
  residual made by a cheap elementwise or layout op that only fusible ops read is never
  written; XLA's fusion pass duplicates its producer into every reader (forward and
  backward) and stores the producer's operands instead; expensive ops (XLA's
  `IsExpensive`: tanh, exp, div, sqrt...), reductions and a matmul's operands are
  stored. On a GELU MLP that is 3 of the jaxpr's 6 [N, F] residuals (matmul output, tanh,
  GELU output), and XLA's temporaries lie between the two sets. Pricing the stored set
  instead of the jaxpr's in the one-stage tables, plus the backward's own buffers at its
  peak (`_cost/_traffic.temporaries`, the liveness walk the pipeline stages use), was
  measured at dad0fc5's parent (`--plans 4`, seed 0): memory within 15% on 12 of 24
  (50%) against 7 of 24 (29%) with the jaxpr's residuals; but on the tests' plans
  compiled with the state donated (like with like: the model prices an update in
  place) it under-predicts: bf16 gpt ZeRO-0/1/3 0.87/0.82/0.90x, a float32 Megatron plan
  0.82x, where the jaxpr's set gives 1.03/1.03/1.26x and 1.14x. The gap on ZeRO-0/1 is
  about one copy of the gradients, which ZeRO-3 (reduced layer by layer) does not show:
  the CPU's one combined gradient all-reduce at the end of the backward writes a buffer
  of its own beside its input (priced since e191666, as a second peak where the
  activations are dead: not measured again with the stored set). An under-prediction promises plans that
  do not fit, so the one-stage tables keep the jaxpr's set; pipeline stages price the
  jaxpr's set too, because that is what a stage's F program hands its B (every residual
  is a program output), and `stored_residuals` where one program holds the residuals
  (a recomputed layer inside its B);
- vgg19's misses on one device (XLA's buffer assignment, single CPU device, 9.5 MiB of
  temporaries against 3.1 MiB residuals + 1.2 MiB gradients): the peak is in the
  forward, at the first max pool, not at the turn. XLA's CPU expands the pool's gradient
  (select_and_scatter_add) into a reduce-window carrying one int32 argmax index per
  dimension and a scatter; the rank iotas of each pool's input shape (20 for vgg19's
  five pools, ~4 MiB) and the scatters' zero buffers are scheduled at the program's
  start and held until used, as are copies of every conv kernel (a layout copy, its
  reversal for the input gradient, a transposed copy: ~3x the kernels). None of this is
  in the jaxpr;
- FLOPs agree within 4% on every plan without ZeRO (18 of 18) and on the 4 pipelines.
  Of the 26 one-stage ZeRO plans (24 of them with a data axis that does not carry the
  batch: ZeRO shards over "data" while the batch is on "model" or whole), 15 disagreed
  at 0853a7b: there a weight gradient is not a partial sum over "data", and XLA computes
  only the shard the device keeps (a [256, 64] piece of a [256, 256] gradient on
  data=4), and the update runs on shards. The cost model now prices both
  (`_cost._tables.zero_shares`); 8 disagree, every one ZeRO with remat: 5 over-predicted
  (1.18-1.24x: XLA's sharding propagation splits the recompute over data too, e.g. mlp
  ZeRO-2 on model 2 x data 4 adds 1.06e6 FLOPs for the recompute where the plan's
  layout recomputes 4.2e6, with collectives that then differ from the plan's), 3
  under-predicted (0.64-0.82x: two ZeRO-3, one vgg19 ZeRO-2; not explained yet).
- two other memory models were measured against this run's plans and not kept. (1) The
  recomputed layers' residuals charged at the phase that holds them, the turn of the
  step or one layer's backward (the largest by unsharded bytes), instead of both at once:
  gpt 7 went 1.48 -> 0.95x, but gpt 3 and 5 fell to 0.42 and 0.34x and bert 1 and 5 to
  0.59 and 0.58x. XLA's peak inside a layer's backward also holds the recompute's own
  working buffers (the attention's score-sized intermediates) and, on the CPU, broadcasts
  of every layer norm's scale materialized in the forward and held to the backward; and
  which phase peaks depends on the sharding. (2) A liveness walk over the whole program
  (buffers written where a kernel XLA cannot fuse makes or reads them, `stored_residuals`
  for what the backward reads, the recompute's buffers alive from its layer's first
  backward read): transformers without remat 0.77-0.91x (from 1.32-1.53x), with remat
  0.36-0.78x, vgg19 0.64-0.96x: nearer on average but under-predicting, which promises
  plans that do not fit. What both miss is the CPU backend's own copies (XNNPACK fusions'
  materialized broadcasts and operand layouts, a bf16 dot's float32 operands), which a
  GPU would not make: matching the CPU's buffers needs a CPU memory model beside the GPU
  one, not a change of the GPU one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fidelity import MODELS, random_plan  # noqa: E402

from automap._zoo import get_model  # noqa: E402

WITHIN = 0.15  # a plan agrees when |predicted / XLA - 1| <= 15%


# ---- third-party families ----------------------------------------------------------------
class FlaxBlock(nn.Module):
    heads: int
    ff: int

    @nn.compact
    def __call__(self, x):
        h = nn.SelfAttention(num_heads=self.heads, use_bias=False)(nn.LayerNorm()(x))
        x = x + h
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.ff)(nn.LayerNorm()(x))))


class FlaxLM(nn.Module):
    """A small pre-norm transformer language model, as a Flax user writes one."""

    vocab: int = 256
    width: int = 64
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.layers):
            x = FlaxBlock(self.heads, 4 * self.width)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _flax_lm():
    model, tx = FlaxLM(), optax.adam(1e-3)
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((16, 32), jnp.int32)))
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply(p, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step, (params, opt_state, {"tokens": tokens, "labels": tokens})


def _eqx_mlp():
    tx = optax.adam(1e-3)
    mlp = eqx.nn.MLP(64, 16, 256, 3, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = jax.vmap(eqx.combine(p, static))(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((64,), jnp.int32)
    return step, (params, opt_state, x, y)


THIRD_PARTY = {"flax_lm": _flax_lm, "eqx_mlp": _eqx_mlp}
ALL = [*MODELS, *THIRD_PARTY]


def program(name: str):
    """(step, abstract args) of a zoo model or a third-party one, the step jitted with its
    parameters and optimizer state (its first two arguments) donated, as training loops
    run it: the new values then reuse the old ones' buffers, as the cost model assumes
    (an update in place). Without donation XLA holds both (see verify's note)."""
    if name in THIRD_PARTY:
        step, args = THIRD_PARTY[name]()
    else:
        model = get_model(MODELS[name][0], **MODELS[name][1])
        step, args = model.step_fn, model.abstract_args()
    return jax.jit(step, donate_argnums=(0, 1)), args


def random_pipeline(graph, groups, rng, devices: int = 8):
    """A random pipeline plan over `devices`: 2 or 4 stages at uniform cuts, its stage
    mesh all "data" or "data" x "model" (model 2, 4, ... under the stage's devices), the
    batch on "data" and every other splittable group on a random axis or none."""
    from automap._pipeline import pipeline_plan, uniform_cuts
    from automap._space import batch_groups

    stages = int(rng.choice([2, 4]))
    n = devices // stages
    meshes = [{"data": n}] + [{"data": n // m, "model": m} for m in (2, 4, 8, 16) if m < n]
    mesh = meshes[rng.integers(len(meshes))] if len(meshes) > 1 else meshes[0]
    cuts = uniform_cuts(graph, groups, stages)
    assignment = {g.id: "data" for g in batch_groups(groups)}
    for g in groups.groups:
        if g.id in assignment or "model" not in mesh or g.divisor % mesh["model"]:
            continue
        if rng.random() < 0.3:
            assignment[g.id] = "model"
    m, schedule = int(rng.choice([1, 2, 4])), str(rng.choice(["gpipe", "1f1b"]))
    zero = int(rng.integers(4))
    return pipeline_plan(graph, groups, cuts, mesh, assignment, m, schedule, zero_stage=zero)


def bench_model(
    name: str,
    plans: int,
    seed: int,
    pipelines: float,
    zero: float,
    verbose: bool,
    target: str | None = None,
) -> dict:
    step, args = program(name)
    show = (lambda plan, report: print(report.summary())) if verbose else None
    rows = verify_drawn(name, step, args, plans, (seed, pipelines, zero), target, show=show)
    return {"model": name, "rows": rows}


def verify_drawn(
    name, step, args, plans, draws, target, cluster=None, show=None, only=None, adjust=None
) -> list[dict]:
    """`plans` plans of `step` drawn by `draw_plan` (`draws`: its seed and shares of pipelines
    and ZeRO; `cluster`'s devices, default 8), each as `adjust(plan)` says, verified (`target`:
    a GPU or TPU slice) into a printed `plan_row`, `show(plan, report)`'s dict joined; a
    refused plan is an error row; `only`: that draw alone (all are drawn)."""
    from automap._capture import capture
    from automap._groups import build_groups
    from automap._verify import verify

    graph = capture(step, *args)
    groups = build_groups(graph)
    rng = np.random.default_rng(draws[0])
    rows = []
    for i in range(plans):
        t0 = time.perf_counter()
        plan = draw_plan(graph, groups, rng, *draws[1:], cluster)
        if only is not None and i != only:
            continue
        plan = adjust(plan) if adjust else plan
        try:
            report = verify(step, plan, *args, target=target)
        except Exception as e:
            rows.append(dict(model=name, plan=i, error=f"{type(e).__name__}: {str(e)[:160]}"))
            print(f"{name:<8} {i:>3} error {rows[-1]['error']}", flush=True)
            continue
        rows.append(plan_row(name, i, plan, report, time.perf_counter() - t0))
        print(plan_line(rows[-1]), flush=True)
        if show is not None:
            rows[-1].update(show(plan, report) or {})
    return rows


def draw_plan(graph, groups, rng, pipelines: float, zero: float, cluster=None):
    """One random plan: a pipeline with probability `pipelines` (over the cluster's
    devices, default 8), else a point of the cluster's shard space, ZeRO 1-3 for a share
    `zero` of them; remat on or off at random."""
    piped = rng.random() < pipelines
    try:
        devices = cluster.devices if cluster else 8
        plan = random_pipeline(graph, groups, rng, devices) if piped else None
    except Exception:
        plan = None
    if plan is None:
        # A random point rarely puts the batch on data, where the space offers ZeRO:
        # a share `zero` of the one-stage plans is drawn again until it has a stage.
        wants_zero = zero > 0 and rng.random() < zero  # --zero 0: the draw before it
        plan = random_plan(graph, groups, rng, zero=True, cluster=cluster)
        for _ in range(500):
            if plan.zero_stage or not wants_zero:
                break
            plan = random_plan(graph, groups, rng, zero=True, cluster=cluster)
    return dataclasses.replace(plan, remat=bool(rng.integers(2)))


def plan_row(name: str, i: int, plan, report, seconds: float) -> dict:
    """One plan's figures: what `plan_line`, `summarize` and --json read."""
    row = dict(
        model=name,
        plan=i,
        mesh=dict(plan.mesh),
        stages=len(plan.stages),
        microbatches=plan.microbatches,
        schedule=plan.schedule if plan.pipelined else "",
        zero=plan.zero_stage,
        remat=plan.remat,
        collectives=report.collectives_match,
        mismatches=list(report.mismatches),
        predicted_memory=report.predicted_memory_bytes,
        xla_memory=report.xla_memory_bytes,
        predicted_flops=report.predicted_flops,
        predicted_flops_as_xla=report.predicted_flops_as_xla,
        xla_flops=report.xla_flops,
        stage_memory=[list(m) for m in report.stage_memory_bytes],
        predicted_breakdown=dict(report.predicted_memory_breakdown),
        xla_breakdown=dict(report.xla_memory_breakdown),
        predicted_comm=dict(report.predicted_comm_bytes),
        xla_comm=dict(report.xla_comm_bytes),
        seconds=seconds,
    )
    row["memory_ratio"] = _ratio(row["predicted_memory"], row["xla_memory"])
    # XLA's TPU live peak (a pipeline's: its busiest stage's): the bytes alive at once, before placement
    row["xla_live_peak"] = report.xla_live_peak_bytes
    row["live_ratio"] = _ratio(row["predicted_memory"], row["xla_live_peak"])
    row["flops_ratio"] = _ratio(row["predicted_flops_as_xla"], row["xla_flops"])
    return row


def _ratio(p, x) -> float | None:
    return p / x if p is not None and x else None


def _within(r) -> bool:
    return r is not None and abs(r - 1) <= WITHIN


def _flops_within(rows: list[dict]) -> tuple[int, int]:
    """(within 15%, compared): XLA's GPU compiler reports no FLOPs (`--target`)."""
    some = [r for r in rows if r["xla_flops"]]
    return sum(_within(r["flops_ratio"]) for r in some), len(some)


def plan_line(r: dict) -> str:
    mesh = "×".join(f"{k}{v}" for k, v in r["mesh"].items())
    pipe = f" {r['stages']}st m{r['microbatches']} {r['schedule']}" if r["stages"] else ""
    mr, fr = r["memory_ratio"], r["flops_ratio"]
    return (
        f"{r['model']:<8} {r['plan']:>3} {mesh:<22}{pipe:<16} zero{r['zero']} "
        f"remat={int(r['remat'])}  comm {'ok' if r['collectives'] else 'NO'}  "
        f"memory {r['predicted_memory'] / 2**20:8.3f} / "
        f"{(r['xla_memory'] or 0) / 2**20:8.3f} MiB = {mr or 0:5.2f}  FLOPs "
        + (
            f"{r['predicted_flops_as_xla']:.3g} / {r['xla_flops']:.3g} = {fr or 0:5.2f}  "
            if r["xla_flops"]
            else "n/a  "
        )
        + (f"live peak {r['live_ratio']:5.2f}  " if r.get("live_ratio") else "")
        + f"({r['seconds']:.1f}s)"
    )


def summarize(results: list[dict]) -> None:
    print(
        f"\n{'model':<10} {'plans':>5} {'errors':>6} {'memory ±15%':>12} {'FLOPs ±15%':>11} "
        f"{'collectives':>11}"
    )
    every = []
    for res in results:
        ok = [r for r in res["rows"] if "error" not in r]
        every += ok
        errors = len(res["rows"]) - len(ok)
        mem = sum(_within(r["memory_ratio"]) for r in ok)
        fl, nf = _flops_within(ok)
        comm = sum(bool(r["collectives"]) for r in ok)
        print(
            f"{res['model']:<10} {len(res['rows']):>5} {errors:>6} {mem:>6}/{len(ok):<5} "
            f"{fl:>5}/{nf:<5} {comm:>5}/{len(ok):<5}"
        )
    n = max(len(every), 1)
    mem = sum(_within(r["memory_ratio"]) for r in every)
    fl, nf = _flops_within(every)
    comm = sum(bool(r["collectives"]) for r in every)
    print(
        f"{'all':<10} {len(every):>5} {'':>6} {mem / n:>12.0%} {fl / max(nf, 1):>11.0%} "
        f"{comm / n:>11.0%}"
    )
    kinds = {
        "ZeRO 1-3": lambda r: r["zero"] > 0,
        "remat": lambda r: r["remat"],
        "pipelines": lambda r: r["stages"] > 0,
    }
    for label, pick in kinds.items():
        some = [r for r in every if pick(r)]
        mem = sum(_within(r["memory_ratio"]) for r in some)
        fl, nf = _flops_within(some)
        print(f"{label:<10} {len(some):>5} {'':>6} {mem:>6}/{len(some):<5} {fl:>5}/{nf:<5}")
    worst = sorted(every, key=lambda r: -abs((r["memory_ratio"] or 0) - 1))[:8]
    print("\nworst memory disagreements (predicted / XLA):")
    for r in worst:
        print("  " + plan_line(r))


def _target(text: str) -> str:
    """--target: a GPU of the gpu-compile extra, or a TPU topology of the plans' 8 devices."""
    from automap._verify import is_tpu_target, target_devices

    if text in ("a100", "h100"):
        return text
    if is_tpu_target(text) and target_devices(text) == 8:
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: give a100, h100 or a TPU topology of 8 devices (v5p:2x2x2, v5e:2x4)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=12, help="random plans per model")
    parser.add_argument("--models", nargs="+", default=ALL, choices=ALL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pipelines", type=float, default=0.25, help="fraction of plans that are pipelines"
    )
    parser.add_argument(
        "--zero", type=float, default=0.25, help="fraction of one-stage plans with ZeRO 1-3"
    )
    parser.add_argument(
        "--target",
        type=_target,
        help="compile for this GPU (a100, h100: the gpu-compile extra) or TPU topology of 8 "
        "chips (v5p:2x2x2, v5e:2x4, v6e:2x4: the tpu-compile extra) without one and hold the "
        "cost model as it prices that device against XLA's buffer assignment and "
        "collectives (XLA's GPU compiler reports no FLOPs)",
    )
    parser.add_argument("--verbose", action="store_true", help="print every verify report")
    parser.add_argument("--json", help="write every plan's row to this file")
    opts = parser.parse_args(argv)
    results = [
        bench_model(m, opts.plans, opts.seed, opts.pipelines, opts.zero, opts.verbose, opts.target)
        for m in opts.models
    ]
    summarize(results)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
