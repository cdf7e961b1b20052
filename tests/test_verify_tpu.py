"""verify(target="v5p:2x2x1"): plans compiled by XLA's TPU compiler on the compile-only
chips of a TPU topology (no TPU here: libtpu describes the slice), held against the cost
model as it prices that TPU."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

import automap as am
from _scripts import load_script
from automap import ApplyError
from automap._cli import app
from automap._cost import CostModel, axis_links, axis_torus_dims
from automap._graph import Role
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import pipeline_plan, uniform_cuts
from automap._verify import live_peak, tpu_devices, verify
from automap._zoo import get_model
from test_verify import tiny_fn_plan, wide_mlp_pipeline

# Every test here loads libtpu (make puts it in .venv/tpu-compile): `-m tpu_compile`
# selects them, `-m "not tpu_compile"` leaves them out where it is not installed.
pytestmark = pytest.mark.tpu_compile


def _small_gpt(topology: str, **recipe):
    """A float32 2-layer GPT (hidden 256, 16 sequences of 128) planned by `am.Recipe(**recipe)`
    on a v5p slice and verified there: (step, args, plan, cluster, report)."""
    spec = get_model(
        "gpt2-xl", layers=2, hidden=256, heads=2, seq=128, batch=16, vocab=512, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology=topology)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(**recipe), cluster=v5p)
    return step, args, plan, v5p, verify(step, plan, *args, target=f"v5p:{topology}")


@pytest.mark.slow  # compiled for 4 v5p chips: ~25 s on two loaded cores
def test_a_plan_compiled_for_a_v5p_slice_holds_what_the_cost_model_prices():
    # Tensor and data parallel with full recomputation on a v5p 2x2x1 slice, priced by the
    # tpu-v5p preset on that torus: XLA's TPU compiler inserts the collectives the cost
    # model predicts, kind by kind and axis by axis, counts the FLOPs it prices, and its
    # buffer assignment holds what the model prices within 15%. (Sized at 90 MiB a chip:
    # at hidden 256 and 8 sequences a chip, 27 MiB, the chip's VMEM and the gaps XLA's
    # placement leaves in HBM move its figure by as much, either way.)
    spec = get_model(
        "gpt2-xl", layers=2, hidden=512, heads=4, seq=128, batch=32, vocab=512, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    assert (v5p.devices, v5p.topology) == (4, (2, 2, 1))
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=2, dp=2, remat="full"), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.collectives_match, report.mismatches
    assert report.xla_comm_bytes["all-reduce@model"] > 1e6  # the activations' partial sums
    assert report.xla_comm_bytes["all-reduce@data"] > 1e6  # the gradients
    # Unlike XLA's GPU compiler, its TPU compiler counts FLOPs: the matmuls dominate.
    assert report.xla_flops == pytest.approx(report.predicted_flops_as_xla, rel=0.05)
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    parts = report.predicted_memory_breakdown
    state = parts["params"] + parts["opt_state"] + parts["other"]
    assert report.xla_memory_breakdown["arguments"] == pytest.approx(state, rel=0.01)
    # XLA's live peak holds the arguments and what is alive at once; here its buffer
    # assignment's figure holds that and the gaps its placement leaves besides
    peak, xla = report.xla_live_peak_bytes, report.xla_memory_breakdown
    assert xla["arguments"] < peak <= report.xla_memory_bytes
    live = f"XLA's live peak {peak / 2**20:.2f} MiB ({report.predicted_memory_bytes / peak:.2f}x)"
    assert live in report.summary()
    assert report.numerics_ok is None  # compiled, never run
    assert "(4 compile-only v5p:2x2x1 TPU devices)" in report.summary()


@pytest.mark.slow  # compiled for 4 v5p chips: ~20 s on two loaded cores
def test_zero1_gradients_are_reduce_scattered_on_a_tpu():
    # ZeRO-1 reduce-scatters the gradients over the data axis: XLA's TPU compiler writes
    # each as an all-reduce-scatter fusion (`_hlo`), held as the reduce-scatter priced.
    # (It all-reduces whole the gradients of 128-wide biases and norms, whose quarter is
    # under a 128-lane tile: here under 1% of the bytes, "trivial".)
    report = _small_gpt("2x2x1", dp=4, zero=1)[-1]
    assert report.collectives_match, report.mismatches
    assert report.xla_comm_bytes["reduce-scatter@data"] > 1e6


@pytest.mark.slow  # compiled for 8 v5p chips: ~25 s on two loaded cores
def test_a_tpu_all_reduces_whole_the_zero_gradients_it_keeps_whole():
    # ZeRO-1 over all 8 chips of a v5p 2x2x2 cube: XLA's TPU compiler all-reduces every
    # gradient whole and slices it (6.7 MB here), as `Lowering.scatter_least_elements`
    # prices a group spanning three torus dimensions; priced as a GPU's, every gradient
    # would be reduce-scattered and the collectives would not match.
    report = _small_gpt("2x2x2", dp=8, zero=1)[-1]
    assert report.collectives_match, report.mismatches
    assert report.xla_comm_bytes["all-reduce@data"] > 1e6
    assert "reduce-scatter@data" not in report.xla_comm_bytes
    assert "reduce-scatter@data" not in report.predicted_comm_bytes


@pytest.mark.slow  # compiled for 8 v5p chips: ~15 s on two loaded cores
def test_a_tpu_all_reduces_whole_the_gradients_split_on_their_lanes():
    # ZeRO-1 at data 4 x model 2 on a v5p 2x2x2: XLA reduce-scatters the gradients whose
    # dot writes ZeRO's split on the major dim of their buffer (the query's and gate's
    # [hidden, out]) and all-reduces whole, in one combined all-reduce, those written
    # transposed ([out, hidden]: key, value, out, up, down, the head) or by the lookup's
    # scatter-add with the split on the lanes (`_scatter.gradient_orders`,
    # `_tiles.minor_split`): 3.5 MiB all-reduced, 1.1 reduce-scattered.
    spec = get_model(
        "llama", layers=1, hidden=512, heads=4, kv_heads=4, ffn=1792, seq=128, batch=16,
        vocab=1024, dtype="bfloat16",
    )  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4, tp=2, zero=1), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    xla = report.xla_comm_bytes
    assert xla["all-reduce@data"] > 2 * xla["reduce-scatter@data"] > 2**20


@pytest.mark.slow  # compiled for 8 v5p chips: ~40 s on two loaded cores
def test_a_tpu_gathers_a_float32_models_zero3_weights_as_bf16():
    # XLA's TPU runs a float32 matmul at the default precision in one bf16 pass, and its
    # ZeRO-3 gathers move the bf16 cast of each weight only matmuls read (the embedding
    # tables, read by a gather, stay float32): 7.1 MiB on this step, where the weights
    # gathered whole as float32 are 13.7 (`Lowering.matmul_operand_bytes`, `_zero`).
    # Priced 7.7: the tied token table, read by the lookup and the head, is priced as one
    # float32 gather where XLA gathers it once as float32 for the lookup and as its bf16
    # cast for the head's matmuls (4 x 256 KiB); not modelled, hence 10%.
    step, args, plan, v5p, report = _small_gpt("2x2x2", dp=8, zero=3)
    xla = report.xla_comm_bytes["all-gather@data"]
    assert report.predicted_comm_bytes["all-gather@data"] == pytest.approx(xla, rel=0.10)
    whole = CostModel(am.capture(step, *args), v5p.with_lowering(matmul_operand_bytes=0))
    cost = whole.estimate(plan)
    gathered = sum(c.bytes for c in cost.collectives if (c.kind, c.axis) == ("all-gather", "data"))
    assert gathered > 1.5 * xla


@pytest.mark.slow  # compiled for 8 v5p chips: ~15 s on two loaded cores
def test_a_tpu_gathers_the_casts_a_recompute_reads():
    # A bfloat16 Llama over float32 parameters, ZeRO-3 with full remat: XLA's TPU moves
    # each weight's bf16 cast across the recompute's barrier and gathers the cast there
    # as the forward does (7.0 MiB), where its GPU gathers the float32 parameter for the
    # recompute (`Lowering.recompute_gathers_casts`; priced so, 9.5 MiB here).
    spec = get_model(
        "llama", layers=2, hidden=256, heads=4, kv_heads=2, ffn=768, seq=128, batch=16,
        vocab=512, dtype="bfloat16",
    )  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    recipe = am.Recipe(dp=8, zero=3, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    xla = report.xla_comm_bytes["all-gather@data"]
    assert report.predicted_comm_bytes["all-gather@data"] == pytest.approx(xla, rel=0.05)
    gpu = CostModel(am.capture(step, *args), v5p.with_lowering(recompute_gathers_casts=False))
    cost = gpu.estimate(plan)
    gathered = sum(c.bytes for c in cost.collectives if (c.kind, c.axis) == ("all-gather", "data"))
    assert gathered > 1.2 * xla


def _small_gpt_plan(leaf_suffix: str, data: int, zero_stage: int = 0, **sizes):
    """A 2-layer float32 GPT's step, arguments, graph, the parameter leaf named by
    `leaf_suffix` and a plan with that leaf's first dim on model (2) and the batch on data
    (`data`), at `zero_stage`."""
    spec = get_model("gpt2-xl", layers=2, hidden=256, heads=2, seq=128, dtype="float32", **sizes)
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    leaf = next(leaf for leaf in graph.inputs if leaf.path.endswith(leaf_suffix))
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    wanted = {groups.of(leaf.tensor, 0): "model", groups.of(batch, 0): "data"}
    mesh = {"data": data, "model": 2}
    return (
        step,
        args,
        graph,
        leaf,
        plan_from_assignment(graph, groups, mesh, wanted, zero_stage=zero_stage),
    )


@pytest.mark.slow  # compiled for 4 v5p chips: ~20 s on two loaded cores
def test_a_tpu_all_reduces_a_partial_sum_only_matmuls_read_as_bf16():
    # A float32 GPT with its hidden dim on model (2) and the batch on data (2), as gpt
    # plan 9 of the TPU bench: the backward's gradient of the attention context (dy @
    # Wo^T, read through a reshape by the attention's two matmuls alone) is a partial sum
    # over model that XLA's TPU converts to the matmuls' bf16 before it all-reduces it,
    # where the forward's Q, K, V projections, read by their bias' add, stay float32
    # (`_rows.narrow_partials`, `Lowering.matmul_operand_bytes`).
    step, args, graph, _, plan = _small_gpt_plan("['query']['kernel']", 2, batch=16, vocab=512)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.collectives_match, report.mismatches
    xla = report.xla_comm_bytes["all-reduce@model"]
    assert report.predicted_comm_bytes["all-reduce@model"] == pytest.approx(xla, rel=0.01)
    # Priced float32, each layer's context gradient (f32 [8, 128, 256], 1 MiB) counts twice.
    wide = CostModel(graph, v5p.with_lowering(matmul_operand_bytes=0)).estimate(plan)
    priced = sum(c.bytes for c in wide.collectives if (c.kind, c.axis) == ("all-reduce", "model"))
    assert priced - xla == pytest.approx(2 * 8 * 128 * 256 * 2, rel=0.01)


@pytest.mark.slow  # compiled for 8 v5p chips: ~20 s on two loaded cores
def test_zero1_reduce_scatters_a_split_tied_tables_parts_apart():
    # A float32 GPT whose tied token table has its rows on model (2), ZeRO-1 over data (4),
    # as gpt plan 8 of the TPU bench: XLA reduce-scatters the lookup's gradient part and
    # the head's apart, each the table's [512, 256] shard, where a whole table's parts are
    # added first and reduce-scattered once (test_zero1_gradients_are_reduce_scattered_on_a_tpu).
    # Priced as one, reduce-scatter@data was 6.62 MiB to XLA's 7.12 (`_kernel.tied_bytes`).
    step, args, _, table, plan = _small_gpt_plan("['embedding']", 4, 1, batch=32, vocab=1024)
    assert plan.specs[table.path] == ("model", None)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    xla = report.xla_comm_bytes["reduce-scatter@data"]
    assert report.predicted_comm_bytes["reduce-scatter@data"] == pytest.approx(xla, rel=0.01)


def _beside_gpt():
    """A 2-layer float32 GPT's step, arguments, graph, groups and the assignment that
    splits its batch on data and nothing else (its kernels whole on every other axis)."""
    spec = get_model(
        "gpt2-xl", layers=2, hidden=256, heads=2, seq=128, batch=32, vocab=1024, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    return step, args, graph, groups, {groups.of(batch, 0): "data"}


@pytest.mark.slow  # compiled for 4 v5p chips: ~15 s on two loaded cores
def test_zero1_over_two_beside_a_wider_axis_splits_the_dots_over_it():
    # A float32 GPT under ZeRO-1 at data 2 x model 2, only the batch split: XLA's SPMD
    # partitioner splits each kernel's gradient dot in two over model, whose devices hold
    # its operands whole, all-reduces each half over data and permutes it to the device
    # ZeRO gives it (3.5 MiB each), where a reduce-scatter of 7 MiB was priced; the
    # lookup's and the position table's are reduce-scattered (`_cost/_beside.py`).
    step, args, graph, groups, wanted = _beside_gpt()
    plan = plan_from_assignment(graph, groups, {"data": 2, "model": 2}, wanted, zero_stage=1)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.collectives_match, report.mismatches
    xla, predicted = report.xla_comm_bytes, report.predicted_comm_bytes
    for key in ("collective-permute@data+model", "all-reduce@data", "reduce-scatter@data"):
        assert predicted[key] == pytest.approx(xla[key], rel=0.01), key
    assert xla["collective-permute@data+model"] > 2 * xla["reduce-scatter@data"]
    # Each split dot runs its half: the kernels' weight gradients, 3.76 GFLOP of the
    # step's 20.75 per chip (priced whole, 1.18x XLA's count).
    assert report.predicted_flops_as_xla == pytest.approx(report.xla_flops, rel=0.01)


@pytest.mark.slow  # a pipeline compiled for 8 v5p chips: ~30-60 s on two loaded cores
@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_stage_splits_the_dots_beside_data_where_its_backward_reduces_them(microbatches):
    # The same GPT in 2 GPipe stages of data 2 x model 2 (v5p 2x2x2), ZeRO-1, as gpt plan
    # 4 of the TPU bench. With one microbatch each stage's backward program makes and
    # reduces its gradients: XLA splits its kernels' dots over model as one program does
    # (the halves all-reduced over data and permuted), the head's part of the tied table
    # too, so stage 1 reduce-scatters none of it, and all-reduces whole the lookup's part
    # (1 MiB, stage 0; `_pipelined._whole_in_backward`). With two, the stage's reduce
    # program reduce-scatters the sums it accumulated, no permute
    # (`_stage_comm.rows_by_phase`).
    step, args, graph, groups, wanted = _beside_gpt()
    cuts = uniform_cuts(graph, groups, 2)
    mesh = {"data": 2, "model": 2}
    plan = pipeline_plan(graph, groups, cuts, mesh, wanted, microbatches, "gpipe", zero_stage=1)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    # ... its dots on their halves where a B call reduces their gradients, whole where
    # the reduce program does: each stage's FLOPs as XLA counts them.
    for _, as_xla, xla_flops in report.stage_flops:
        assert as_xla == pytest.approx(xla_flops, rel=0.01)
    xla, predicted = report.xla_comm_bytes, report.predicted_comm_bytes
    permutes = [f"collective-permute@data+model (stage {s})" for s in (0, 1)]
    if microbatches == 2:
        assert not [key for key in {*xla, *predicted} if key.startswith("collective-permute")]
        return
    for key in (*permutes, "all-reduce@data (stage 0)", "all-reduce@data (stage 1)"):
        assert predicted[key] == pytest.approx(xla[key], rel=0.02), key
    assert "reduce-scatter@data (stage 1)" not in xla  # the biases' 16 KiB all-reduced whole
    assert xla["all-reduce@data (stage 0)"] > xla[permutes[0]] + 1024 * 256 * 4  # the lookup's


@pytest.mark.parametrize(("topology", "gathered"), [("4x4x4", False), ("2x4x4", True)])
def test_a_tpu_gathers_over_a_whole_slice_as_an_all_reduce(topology, gathered):
    # ZeRO-1 over every chip of a slice: the updated parameters' all-gather over data is
    # an all-reduce of the gathered buffer in XLA's TPU compile where the slice has 64
    # chips (`Lowering.gather_all_reduced_from`), an all-gather where it has 32. Priced as
    # a GPU's, the 64-chip step would hold an all-gather XLA does not have.
    v5p = am.Cluster.preset("tpu-v5p", topology=topology)
    spec = get_model("mlp", layers=2, hidden=1024, batch=2 * v5p.devices)
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=v5p.devices, zero=1), cluster=v5p)
    report = verify(step, plan, *args, target=f"v5p:{topology}")
    assert report.collectives_match, report.mismatches
    assert ("all-gather@data" in report.xla_comm_bytes) is gathered
    assert ("all-gather@data" in report.predicted_comm_bytes) is gathered
    # Gathered or all-reduced, the updated parameters move the same bytes.
    assert report.predicted_comm_bytes["all-reduce@data"] == pytest.approx(
        report.xla_comm_bytes["all-reduce@data"], rel=0.05
    )


@pytest.mark.slow  # a pipeline compiled for 8 v5p chips: ~55 s on two loaded cores
def test_a_pipeline_compiled_for_a_v5p_slice_holds_what_its_stages_are_priced():
    # A bfloat16 GPT in 2 stages x data 2 x model 2 on a v5p 2x2x2 slice, each stage's
    # programs compiled on its half of the slice: its collectives, stage by stage, are
    # the cost model's; each stage's memory and FLOPs within 15%.
    spec = get_model("gpt-1.3b", layers=4, hidden=256, heads=2, seq=256, batch=16, vocab=1024,
                     dtype="bfloat16", softmax="fused")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    recipe = am.Recipe(pp=2, dp=2, tp=2, microbatches=4, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    for s in range(2):
        assert report.xla_comm_bytes[f"all-reduce@data (stage {s})"] > 1e6  # the gradients
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.15)
    for _, as_xla, xla in report.stage_flops:
        assert as_xla == pytest.approx(xla, rel=0.05)
    # each stage's live peak: its programs' (libtpu's peak_memory_in_bytes) with what the
    # runtime holds besides, as its buffer-assignment figure is combined
    assert report.xla_live_peak_bytes > report.xla_memory_breakdown["held inputs"]
    assert "XLA's live peak" in report.summary()


def test_a_bf16_stage_holds_the_16_bit_gradients_its_backward_returns():
    # With one microbatch there is no running sum: a stage holds the gradients its B
    # program returns until the update widens them, a bfloat16 step's at 16 bits (they
    # were priced at the float32 parameters' width, 2x XLA's). Its B program also holds
    # the bf16 [128, 4096] gradient stage 1 sends back, an argument, while it runs.
    step, args, plan = wide_mlp_pipeline("bfloat16")
    report = verify(step, plan, *args, target="v5p:2x2x2")
    (priced, xla), _ = report.stage_memory_bytes
    assert priced == pytest.approx(xla, rel=0.15), report.summary()
    grads = report.predicted_memory_breakdown["grads"]
    assert grads == pytest.approx(report.xla_memory_breakdown["gradients"], rel=0.05)


def test_compile_only_tpus_say_what_they_cannot_do():
    with pytest.raises(ApplyError, match="not a TPU topology"):
        tpu_devices("v5x:4x4", (16,))
    with pytest.raises(ApplyError, match="3-D torus of chips"):
        tpu_devices("v5p:4x4", (16,))
    with pytest.raises(ApplyError, match="has 8: plan for 8 devices, or name a topology"):
        tpu_devices("v5p:2x2x2", (4, 4))
    # The mesh as JAX lays it on the torus: the fastest axis on physical neighbours.
    devices = tpu_devices("v5p:2x2x2", (2, 4))
    assert len(devices) == 8 and {d.platform for d in devices} == {"tpu"}
    assert jax.devices()[0].platform == "cpu"  # this process's backend is unchanged


@pytest.mark.parametrize(("rows", "vmems"), [(16384, True), (65536, False)])
def test_libtpus_live_peak_counts_the_busier_memory_of_the_two(tmp_path, rows, vmems):
    # `_compare.live_peak`: libtpu's peak_memory_in_bytes is the arguments, the outputs
    # and the temporaries alive at the busiest step of HBM or of the chip's VMEM, whichever
    # holds more, read against the buffer assignment's two temporary allocations. A
    # [rows, 1024] float32 chain a chip: at 16384 rows memory-space assignment holds more
    # of it in VMEM (36 MiB) than HBM's live peak (32 MiB); at 65536, HBM's 128 MiB win.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    reader = load_script("read_buffer_assignment")
    mesh = Mesh(np.array(tpu_devices("v5p:2x2x1", (4,))), ("data",))

    def chain(x, w):
        h = jnp.tanh(x @ w)
        return (jnp.tanh(h @ w.T) @ w).sum(), h @ w

    x = jax.ShapeDtypeStruct(
        (4 * rows, 1024), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data"))
    )
    w = jax.ShapeDtypeStruct(
        (1024, 1024), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())
    )
    options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True}
    stats = (compiled := jax.jit(chain).lower(x, w).compile(options)).memory_analysis()
    hbm = reader.read(tmp_path).busiest()[1]
    vmem = reader.read(tmp_path, space=reader.VMEM).busiest()[1]
    assert (vmem > hbm) is vmems
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    assert live_peak(compiled, "v5p:2x2x1") == held + max(hbm, vmem)
    assert live_peak(compiled, None) is None  # a GPU's or the CPU's field means otherwise


def test_the_cost_model_lays_a_mesh_on_the_torus_as_jax_does():
    # libtpu's chips of a v5p 4x4x4 slice, laid by create_device_mesh for a 16 x 4 mesh:
    # the model axis on one whole dimension, the data axis on the other two, as the cost
    # model lays them (`_cost/_torus.py`, with stand-in chips) and prices them.
    grid = np.array([d.coords for d in tpu_devices("v5p:4x4x4", (16, 4))]).reshape(16, 4, 3)
    model = [dim for dim in range(3) if len(set(grid[0, :, dim].tolist())) > 1]
    data = [dim for dim in range(3) if len(set(grid[:, 0, dim].tolist())) > 1]
    assert len(model) == 1 and len(data) == 2 and not set(model) & set(data)
    links = axis_links(am.Cluster.preset("tpu-v5p", topology="4x4x4"), {"data": 16, "model": 4})
    assert links["model"].bandwidth * 2 == links["data"].bandwidth


def test_automap_verify_compiles_for_a_tpu(tmp_path, monkeypatch):
    # The weight gradient is a partial sum over the batch split, all-reduced on "data" on
    # a v5e 4x4 slice as on the CPU; in a child process, as the CLI runs it.
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    path = plan.save(tmp_path / "plan.json")
    out = CliRunner().invoke(app, ["verify", str(path), "--target", "v5e:4x4", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["xla_comm_bytes"] == {"all-reduce@data": 32 * 4 * 4}
    assert report["xla_memory_bytes"] > 0 and report["target"] == "v5e:4x4"
    out = CliRunner().invoke(app, ["verify", str(path), "--target", "v5p:2x2x1", "--json"])
    assert out.exit_code != 0 and "TPU topology v5p:2x2x1 has 4" in out.output


def test_a_tpu_holds_its_state_in_tiles_as_priced():
    # A 64-wide MLP at data 2 x model 4: XLA's TPU compiler lays each
    # shard in (8, 128) tiles and its buffer assignment's arguments (the parameters,
    # optimizer state and batch a chip holds) are what the cost model prices in tiles
    # (`_cost/_tiles.py`), not the shards' bytes.
    spec = get_model("mlp", hidden=64)
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=2, tp=4), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    held = report.xla_memory_breakdown["arguments"]
    parts = report.predicted_memory_breakdown
    assert parts["params"] + parts["opt_state"] + parts["other"] == pytest.approx(held, rel=0.01)
    bytes_only = CostModel(am.capture(step, *args), v5p.with_lowering(tile_padding=False))
    plain = bytes_only.estimate(plan).memory_breakdown
    assert plain["params"] + plain["opt_state"] + plain["other"] < 0.6 * held


@pytest.mark.slow  # two policies compiled for 4 v5p chips: ~50 s of CPU
def test_projections_keeps_less_than_selective_in_a_tpus_buffer_assignment():
    # MaxText's `minimal` ("projections": each layer recomputed but its projections) on
    # a reduced Llama at data 2 x model 2 on a v5p 2x2x1: XLA's TPU compiler inserts the
    # collectives priced for it and for selective, and holds less for it than for
    # selective, as the cost model does (measured at 6c09468: XLA 35.7 against 50.4 MB,
    # priced 45.8 against 55.9). Two layers at sequence 256 keep both savings (29% and
    # 18%) clear of the 10% asserted, in half the compile time of 4 layers at sequence
    # 512 (at batch 16 XLA's is 16%, too near it; XLA 351
    # against 444 MB, priced 281 against 491: there the model overstates the saving, as
    # at the recomputed layer's backward XLA holds more bf16 [b, h, s, s] buffers at
    # once than it prices). With hidden 512, sequence 128, batch 128 and 8 layers, XLA
    # reduce-scatters and all-gathers over model the partial sums priced as all-reduced
    # under projections: not yet modelled.
    spec = get_model("llama", layers=2, hidden=256, heads=4, kv_heads=4, head_dim=128,
                     ffn=512, seq=256, batch=32, vocab=512)  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    reports = {}
    for remat in ("selective", "projections"):
        recipe = am.Recipe(tp=2, dp=2, remat=remat)
        plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
        reports[remat] = report = verify(step, plan, *args, target="v5p:2x2x1")
        assert report.collectives_match, (remat, report.mismatches)
    xla = {k: r.xla_memory_breakdown["temporaries"] for k, r in reports.items()}
    priced = {k: r.predicted_memory_breakdown["activations"] for k, r in reports.items()}
    assert xla["projections"] < 0.9 * xla["selective"], xla
    assert priced["projections"] < 0.9 * priced["selective"], priced


def test_a_mesh_that_splits_a_torus_dimension_is_laid_as_the_cost_model_prices_it():
    # A 32 x 2 mesh on a v5p 4x4x4 cube splits one 4-chip dimension over both axes; the
    # search offers it and the cost model prices it laid by create_device_mesh with the
    # split allowed (`_cost._torus`): verify lays the compile-only chips the same way
    # (each axis varying along the torus dimensions priced) rather than refusing the plan.
    v5p = am.Cluster.preset("tpu-v5p", topology="4x4x4")
    for mesh in [{"data": 32, "model": 2}, {"model": 2, "data": 32}, {"data": 8, "model": 8}]:
        devices = tpu_devices("v5p:4x4x4", tuple(mesh.values()))
        coords = np.array([d.coords for d in devices]).reshape(*mesh.values(), 3)
        for axis, name in enumerate(mesh):
            line = np.moveaxis(coords, axis, 0)[(slice(None),) + (0,) * (len(mesh) - 1)]
            spanned = sum(len(set(line[:, dim])) > 1 for dim in range(3))
            assert spanned == axis_torus_dims(v5p, mesh)[name], (mesh, name)


def _replicated_gpt(hidden: int, batch: int):
    """A float32 2-layer GPT (vocab 4096) and its data-parallel plan over a v5p 2x2x1:
    each chip holds whole [batch / 4, 128, ...] activations, as the fidelity bench's
    replicated-batch plans do."""
    spec = get_model("gpt2-xl", layers=2, hidden=hidden, heads=hidden // 64, seq=128,
                     batch=batch, vocab=4096, dtype="float32")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4), cluster=v5p)
    return step, args, plan, v5p


@pytest.mark.slow  # compiled for 4 v5p chips: ~35 s on two loaded cores
def test_a_tpu_makes_float32_matmul_operands_again_and_keeps_them_in_bf16():
    # XLA's TPU fuses the elementwise chain that makes a float32 matmul operand into the
    # matmul (GELU's output and tanh, the layer norms' outputs, softmax's probabilities
    # are made again in the backward's matmul kernels, not stored) and keeps the
    # operands only matmuls read (q, k, v, the attention's context) as bf16, the width
    # it runs them in (`Lowering.fuses_matmul_operands`, `matmul_operand_bytes`). Priced
    # as the GPU's rules keep them, the same plan is 1.5x XLA's buffers (1.27x without
    # the fusion, 1.08x without the bf16 width); as the TPU keeps them, 0.99x.
    step, args, plan, v5p = _replicated_gpt(hidden=256, batch=64)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.05)
    graph = am.capture(step, *args)
    for rule in ({"fuses_matmul_operands": False}, {"matmul_operand_bytes": 0}):
        without = CostModel(graph, v5p.with_lowering(**rule)).estimate(plan).memory_bytes
        assert without > 1.05 * report.xla_memory_bytes, rule


@functools.cache
def _split_beside_gpt():
    """A float32 2-layer GPT (hidden 512, vocab 4096) under ZeRO-2 at data 2 x model 2 on
    v5p 2x2x1, only its batch split (32 sequences of 128 a chip): its graph, plan, cluster
    and verify's report. XLA splits its weight-gradient dots beside data (`_beside.py`)."""
    spec = get_model("gpt2-xl", layers=2, hidden=512, heads=8, seq=128, batch=64, vocab=4096,
                     dtype="float32")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    wanted = {groups.of(batch, 0): "data"}
    plan = plan_from_assignment(graph, groups, {"data": 2, "model": 2}, wanted, zero_stage=2)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    return graph, plan, v5p, verify(step, plan, *args, target="v5p:2x2x1")


@pytest.mark.slow  # compiled for 4 v5p chips: ~30 s on two loaded cores
def test_a_tpu_holds_a_wide_softmax_shift_beside_its_logits():
    # With 512-wide rows into f32 [32, 128, 4096] logits a chip, XLA's TPU writes the
    # loss' shift (logits less their row max) in a kernel of its own, the logits alive
    # beside it (`Lowering.fused_row_elements`); priced as made again from the logits,
    # the step's peak misses one of them: 0.89x XLA's live peak, 1.02x with it.
    graph, plan, v5p, report = _split_beside_gpt()
    assert report.predicted_memory_bytes == pytest.approx(report.xla_live_peak_bytes, rel=0.05)
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    fused = CostModel(graph, v5p.with_lowering(fused_row_elements=0)).estimate(plan)
    assert fused.memory_bytes < 0.92 * report.xla_live_peak_bytes


@pytest.mark.slow  # compiled for 4 v5p chips: ~30 s on two loaded cores
def test_a_tpu_makes_a_real_vocabularys_softmax_shift_again_in_its_readers():
    # Rows of 16384 (a vocabulary past `Lowering.apart_row_elements`): XLA's TPU writes
    # no shift beside the f32 [32, 128, 16384] logits a chip, its loss kernels make it
    # again from the logits. Priced so, 1.04x XLA's buffer assignment; priced as the
    # 4096-wide rows above (the bound off), the peak holds a 256 MiB shift XLA never
    # writes: 1.46x.
    spec = get_model("gpt2-xl", layers=1, hidden=512, heads=8, seq=128, batch=128,
                     vocab=16384, dtype="float32")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.1)
    graph = am.capture(step, *args)
    apart = CostModel(graph, v5p.with_lowering(apart_row_elements=0)).estimate(plan)
    assert apart.memory_bytes > 1.3 * report.xla_memory_bytes


@pytest.mark.slow  # shares the compile above
def test_a_tpu_holds_the_operands_of_the_gradient_dots_it_splits():
    # The same plan: XLA splits each weight-gradient dot beside data, and a split dot
    # reads its float32 operands an elementwise chain makes (the norms' outputs, GELU's)
    # from bf16 buffers the forward writes, where a whole dot makes them again inside
    # (`Lowering.holds_split_operands`): 52 MiB a chip here. Without them the priced
    # peak is 0.89x XLA's live peak; with them 1.02x.
    graph, plan, v5p, report = _split_beside_gpt()
    assert report.collectives_match, report.mismatches
    assert "collective-permute@data+model" in report.xla_comm_bytes  # the dots are split
    assert report.predicted_memory_bytes == pytest.approx(report.xla_live_peak_bytes, rel=0.05)
    fused = CostModel(graph, v5p.with_lowering(holds_split_operands=False)).estimate(plan)
    assert fused.memory_bytes < 0.92 * report.xla_live_peak_bytes
    held = report.predicted_memory_bytes - fused.memory_bytes
    assert held == pytest.approx(52 * 2**20, rel=0.05)


@pytest.mark.slow  # compiled for 8 v5p chips: ~45 s on two idle cores
def test_a_tpu_stage_runs_its_split_mlp_gradient_dot_at_its_backwards_end():
    # A float32 2-layer GPT in 2 GPipe stages (cut at layer 0's second MLP matmul) of
    # data 2 x model 2, one microbatch, ZeRO-1, full recomputation: each B program
    # reduces the gradients it makes, and XLA splits their dots beside data. Stage 1's B
    # runs layer 1's first MLP weight-gradient dot after the layer's attention backward,
    # holding the two float32 [64, 128, 2048] values it reads (made for it with the
    # hidden's gradient) from then to there (`Lowering.late_split_dots`). Priced so,
    # stage 1 is 1.00x XLA's; priced as run in order, 0.76x.
    spec = get_model("gpt2-xl", layers=2, hidden=512, heads=8, seq=128, batch=128,
                     vocab=4096, dtype="float32")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    cut = [op.index for op in graph.ops if op.primitive == "dot_general"][7]
    wanted = {groups.of(batch, 0): "data"}
    mesh = {"data": 2, "model": 2}
    plan = pipeline_plan(graph, groups, (cut,), mesh, wanted, 1, "gpipe", zero_stage=1)
    plan = dataclasses.replace(plan, remat=True)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert "collective-permute@data+model (stage 1)" in report.xla_comm_bytes  # split dots
    _, (priced, xla) = report.stage_memory_bytes
    assert priced == pytest.approx(xla, rel=0.05), report.summary()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    # (stage 1 is the larger either way)
    held = CostModel(graph, v5p.with_lowering(late_split_dots=False)).estimate(plan).memory_bytes
    assert held < 0.85 * xla
    assert priced - held == pytest.approx(2 * 64 * 128 * 2048 * 4, rel=0.25)


@pytest.mark.slow  # compiled for 8 v5p chips: ~45 s on two idle cores
def test_a_tpu_stage_frees_each_recomputed_residual_after_its_last_read():
    # A bf16 2-layer Llama in two 1F1B stages of data 4 (cut at layer 0's MLP), one
    # microbatch, full recomputation. XLA frees each value a recomputed layer stores when
    # the layer's backward has last read what it serves: the SwiGLU's after the MLP's
    # backward, before the attention's. Priced so, stage 1 is 1.03x XLA's; priced with
    # every such value held to the layer's last backward read, 1.09x.
    spec = get_model("llama", layers=2, hidden=512, heads=8, kv_heads=2, ffn=1536, seq=128,
                     vocab=4096, batch=128, dtype="bfloat16")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    cut = [op.index for op in graph.ops if op.primitive == "dot_general"][7]
    plan = pipeline_plan(graph, groups, (cut,), {"data": 4}, {groups.of(batch, 0): "data"})
    plan = dataclasses.replace(plan, remat=True)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    _, (priced, xla) = report.stage_memory_bytes
    assert priced == pytest.approx(xla, rel=0.05), report.summary()


def small_llama(**sizes):
    """A 1-layer Llama (by default hidden 256, 4 heads in 2 key/value groups, seq 128,
    batch 16; `sizes` override them): its jitted step (state donated), abstract args,
    captured graph and groups."""
    sizes = dict(hidden=256, heads=4, kv_heads=2, ffn=512, seq=128, vocab=512, batch=16) | sizes
    spec = get_model("llama", **(dict(layers=1) | sizes))
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = am.capture(spec.step_fn, *args)
    return step, args, graph, build_groups(graph)


def test_a_tpu_stores_a_recomputed_softmaxs_exp_from_its_matmul_kernel():
    # A recomputed bf16 Llama layer at data 4 on v5p 2x2x1, rows of 512 keys: the kernel
    # of the query-key matmul runs the mask, the row max and the exp and writes the f32
    # exp and its row sums, never the bf16 scores, and the backward reads that exp
    # (`_residuals._row_kernel_exp`). Priced as made again from the scores (the rule off
    # with `fused_row_elements`), the peak is 0.83x XLA's live peak; as stored, 1.00x.
    step, args, graph, _ = small_llama(dtype="bfloat16", seq=512)
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4, remat="full"), cluster=v5p)
    report = verify(step, plan, *args, target="v5p:2x2x1")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_live_peak_bytes, rel=0.05)
    remade = CostModel(graph, v5p.with_lowering(fused_row_elements=0)).estimate(plan)
    assert remade.memory_bytes < 0.9 * report.xla_live_peak_bytes
    # the f32 exp less the bf16 scores: [4 sequences, 4 heads, 512, 512] a chip, 2 B each
    stored = report.predicted_memory_bytes - remade.memory_bytes
    assert stored == pytest.approx(4 * 4 * 512 * 512 * 2, rel=0.05)
