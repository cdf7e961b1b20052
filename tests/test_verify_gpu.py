"""verify(target=...): plans compiled by XLA's GPU compiler on compile-only GPUs (no GPU
here: JAX's CUDA plugin compiles for a described A100), held against the cost model as it
prices that GPU."""

import dataclasses
import json
import re

import jax
import pytest
from typer.testing import CliRunner

import automap as am
from automap import ApplyError
from automap._capture import capture
from automap._cli import app
from automap._cost import CostModel
from automap._graph import Role
from automap._groups import build_groups, narrow_params, plan_from_assignment, zero_region
from automap._verify import compile_plan, compiled_memory, gpu_devices, target_config, verify
from automap._zoo import get_model
from test_verify import tiny_fn_plan

# Every test here loads JAX's CUDA plugin (make puts it in .venv/gpu-compile): `-m gpu_compile`
# selects them, `-m "not gpu_compile"` leaves them out where the plugin is not installed.
pytestmark = pytest.mark.gpu_compile


def _gpt():
    spec = get_model(
        "gpt2-xl", layers=2, hidden=64, heads=8, seq=32, batch=16, vocab=128, dtype="float32"
    )
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


@pytest.mark.slow  # compiled for 8 A100s (each of these is tens of seconds loaded)
@pytest.mark.parametrize("recipe", [am.Recipe(tp=8), am.Recipe(tp=2, dp=4, remat="full")])
def test_a_gpu_program_keeps_the_residuals_the_gpu_model_prices(recipe):
    # XLA's GPU fusion makes a cheap residual (GELU's chain, LayerNorm's centred input)
    # again in each backward reader and keeps its producer's operands: the a100 model
    # prices those (`Lowering.remakes_residuals`), within 15% of the GPU buffer assignment,
    # where the jaxpr's residuals (what the CPU keeps) are 1.3x it and more at the turn of
    # the step (under remat the peak is the gradients' reduction, at the end).
    step, args = _gpt()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args, target="a100")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    assert report.xla_flops is None and report.numerics_ok is None  # compiled, never run
    graph = capture(step, *args)
    if recipe.remat == "none":
        jaxpr_set = a100.with_lowering(remakes_residuals=False)
        kept_all = CostModel(graph, jaxpr_set).estimate(plan).memory_bytes
        assert kept_all > 1.3 * report.xla_memory_bytes
    if recipe.dp == 1:
        # Tensor parallel alone: the model axis's all-reduces are the GPU's to the byte. The
        # input gradient of the separate Q, K and V projections is three partial sums,
        # which XLA's GPU adds before one all-reduce (`Lowering.reassociates_all_reduce`);
        # all-reducing each (as the CPU does) is 40% more.
        assert report.collectives_match, report.mismatches
        each = a100.with_lowering(reassociates_all_reduce=False)
        cost = CostModel(graph, each).estimate(plan)
        model_bytes = sum(c.bytes for c in cost.collectives if c.axis == "model")
        assert model_bytes > 1.3 * report.xla_comm_bytes["all-reduce@model"]
    # The stored state is the same on both sides: arguments are parameters, optimizer
    # state and the batch.
    parts = report.predicted_memory_breakdown
    state = parts["params"] + parts["opt_state"] + parts["other"]
    assert report.xla_memory_breakdown["arguments"] == pytest.approx(state, rel=0.01)


def _mlp():
    spec = get_model("mlp")
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


@pytest.mark.slow  # compiled for 8 A100s
@pytest.mark.parametrize(
    "model, recipe",
    [
        (_mlp, am.Recipe(tp=8)),
        (_mlp, am.Recipe(dp=8)),
        (_gpt, am.Recipe(dp=8, zero=2)),
        # ZeRO-3 with remat: was priced 1.10-1.16x XLA (a recomputed layer's GELU tanh
        # priced as stored; every gradient held to one reduction), now within 10%.
        (_gpt, am.Recipe(dp=8, zero=3, remat="full")),
    ],
)
def test_a_gpu_step_peaks_at_one_moment(model, recipe):
    # XLA's GPU scheduler frees each buffer at its last reader: the peak is the busiest
    # moment of the step (`_cost/_liveness.py`), not every activation and every gradient
    # together. Tensor parallel: each gradient dies in its update as soon as it is made
    # (the summed model is 1.17x the GPU's). Data parallel: the gradients are held for one
    # combined all-reduce that copies them once more, after the activations are gone
    # (0.81x). ZeRO-2: the reduce-scatter writes shards, no copy (1.32x). ZeRO-3 with
    # remat: the forward's gathered parameters kept for the backward, and a recomputed
    # layer's GELU made again in its backward's kernels, its tanh never stored (priced
    # stored, 1.10x: `_cost/_residuals.py`).
    step, args = model()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args, target="a100")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.1)
    summed = a100.with_lowering(frees_at_last_use=False)
    graph = capture(step, *args)
    if recipe.zero < 3:
        off = CostModel(graph, summed).estimate(plan).memory_bytes / report.xla_memory_bytes
        assert abs(off - 1) > 0.15


@pytest.mark.slow  # four plans compiled for A100s: ~100 s on two cores
@pytest.mark.parametrize("expert", ["data_parallel", "zero1"])
def test_a_step_that_donates_nothing_holds_its_new_state_beside_the_old(expert):
    # Jitted without donate_argnums, the step's update cannot write over its arguments:
    # XLA holds the new parameters and moments as outputs of their own from the update to
    # the end (`_cost/_outputs.py`), beside the reduced gradients. Priced in place, data
    # parallel was 0.75x the GPU's buffers; the donating step writes over the old state.
    spec = get_model(
        "gpt2-xl", layers=2, hidden=64, heads=8, seq=32, batch=16, vocab=128, dtype="float32"
    )
    args = spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    for step in (spec.step_fn, jax.jit(spec.step_fn, donate_argnums=(0, 1))):
        plan = am.expert_plans(step, *args, cluster=a100)[expert]
        report = verify(step, plan, *args, target="a100")
        assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
        held = report.predicted_memory_breakdown["outputs"]
        if step is spec.step_fn:
            assert report.xla_memory_breakdown["aliased"] == 0
            if expert == "data_parallel":  # its peak is the update: the state twice
                assert held == pytest.approx(report.xla_memory_breakdown["outputs"], rel=0.01)
                in_place = report.predicted_memory_bytes - held
                assert in_place < 0.85 * report.xla_memory_bytes
            assert not any("in place" in n for n in report.notes)
        else:
            assert report.xla_memory_breakdown["aliased"] > 0
            assert held < 0.01 * report.predicted_memory_bytes  # the loss alone


@pytest.mark.slow  # compiled for 8 A100s
def test_a_recomputed_layer_holds_its_combined_all_reduces_copy():
    # The hidden dim split under remat: every projection of it is a partial sum. A
    # recomputed layer's all-reduces depend on its input alone, and XLA's combiner joins
    # them with the backward's, copying their operands into one buffer at the recompute:
    # the step's peak (`_cost/_buffers.combined_copies`), 0.78x the GPU's without it.
    spec = get_model("gpt2-xl", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=512,
                     dtype="float32")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = capture(step, *args)
    groups = build_groups(graph)
    embed = next(x for x in graph.inputs if "token_embed" in x.path)
    hidden = groups.tensor_groups[embed.tensor][1]
    plan = plan_from_assignment(graph, groups, {"model": 8}, {hidden: "model"})
    plan = dataclasses.replace(plan, remat=True)
    report = verify(step, plan, *args, target="a100")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.1)


def test_a_recompute_fences_nothing_made_from_literals_alone():
    # At a batch of one the masked softmax's fill, broadcast to the scores' shape, and
    # its mask are inputs of each recomputed layer (made outside it). Fenced by the
    # recompute's barrier, XLA wrote both whole (float32 and pred [1, 1, 256, 256] here,
    # [1, 6, 2048, 2048] at hidden 6144 on 8: 120 MiB a device) and held them from the
    # forward; read as they are (`_run/_recompute.literal_made`), it makes them inside
    # the kernels that read them, and the step holds less than the model prices.
    spec = get_model("gpt-1.3b", layers=2, hidden=128, heads=8, seq=256, batch=1, vocab=256,
                     dtype="bfloat16", softmax="fused")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=8, remat="full"), cluster=a100)
    compiled = compile_plan(step, plan, args, target="a100")
    fenced = set()
    for line in compiled[1].as_text().splitlines():
        if "optimization_barrier" in line and re.search(r"= \(.*\) tuple\(", line):
            fenced |= set(re.findall(r"\w+\[[\d,]+\]", line.split(") tuple(")[0]))
    assert fenced and not [shape for shape in fenced if shape.endswith("256,256]")]
    report = verify(step, plan, *args, target="a100", compiled=compiled)
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)


@pytest.mark.slow  # compiled for 8 A100s
def test_a_mixed_precision_step_keeps_what_the_gpu_keeps():
    # A bfloat16 GPT (float32 parameters, Megatron's fused softmax): XLA's GPU computes
    # GELU's tanh in float32 and keeps it so for the backward, and, allowed excess
    # precision, the softmax's backward reads the float32 probabilities it makes again from
    # the scores, which it keeps besides the bfloat16 probabilities the next matmul reads.
    # Priced as 16-bit residuals alone this plan was 0.82x the GPU's buffers.
    spec = get_model("gpt-1.3b", layers=4, hidden=128, heads=8, seq=128, batch=8, vocab=512,
                     dtype="bfloat16", softmax="fused")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=2, dp=4), cluster=a100)
    report = verify(step, plan, *args, target="a100")
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.1)


@pytest.mark.slow  # compiled for 8 A100s
@pytest.mark.parametrize("pp", [1, 2])
def test_zero3_gathers_a_mixed_precision_steps_bf16_weights(pp):
    # A bf16 step casts its float32 weights before use; ZeRO-3 leaves them sharded, and
    # XLA gathers the casts (where an op needs them whole, after the elementwise ops that
    # keep the sharding): half the float32 parameters' bytes, in the forward and again in
    # the backward (a pipeline: once, in the program that casts them). The backward makes
    # its copies again, so the forward's die with the forward. (The CPU gathers them in
    # float32: `Lowering.collective_float_bytes`.)
    step, args = _bf16_gpt()
    a100 = am.Cluster.preset("a100", devices=8)
    recipe = am.Recipe(pp=pp, dp=8 // pp, zero=3, microbatches=1 if pp == 1 else 4)
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    gathered = sum(v for k, v in report.xla_comm_bytes.items() if k.startswith("all-gather"))
    params = capture(step, *args).role_bytes(Role.PARAM)
    assert gathered < (1.05 if pp == 1 else 0.55) * params
    # In two stages, XLA's programs hold 0.85 MB more in flight and in temporaries (F's
    # outputs 3.23 MB and 1.15 MB, against 3.53 MB priced): 0.87x on both stages, not
    # yet named (issue 27). It was within 10% while each stage's weight casts were
    # counted twice, once as a residual (`_cost/_traffic._residuals`).
    rel = 0.1 if pp == 1 else 0.15
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=rel)


@pytest.mark.slow  # a pipeline compiled for 8 A100s
def test_a_pipeline_stage_holds_its_reduce_programs_buffers():
    # With several microbatches a stage reduces its gradients' running sums once per step
    # in a program of its own; its arguments are not donated, so on the GPU it writes the
    # reduced gradients beside them, and before that the copy its combined all-reduce
    # reduces: the stage's peak on a model whose gradients outweigh a microbatch's
    # activations (`_cost/_traffic.reduce_program`), 0.75x XLA's without them.
    step, args = _mlp()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(pp=2, dp=4, microbatches=4), cluster=a100)
    report = verify(step, plan, *args, target="a100")
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.1)
    lean = a100.with_lowering(frees_at_last_use=False)
    without = am.estimate(step, *args, plan=plan, cluster=lean)
    assert without.memory_bytes < 0.85 * report.xla_memory_bytes


def test_a_tied_embeddings_gradient_is_all_reduced_once_on_a_gpu():
    # BERT's word embedding is read twice: by the lookup (its gradient a scatter-add) and,
    # transposed, by the output projection (its gradient a matmul, transposed there and
    # back). XLA's GPU folds the two transposes, adds the two partial sums and all-reduces
    # the table once; priced as two all-reduces it was one table's bytes (+24%) over.
    spec = get_model(
        "bert-base", layers=2, hidden=128, heads=4, seq=64, batch=16, vocab=1024, dtype="float32"
    )
    args = spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.expert_plans(spec.step_fn, *args, cluster=a100)["data_parallel"]
    report = verify(spec.step_fn, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    table = 1024 * 128 * 4
    reduced = report.xla_comm_bytes["all-reduce@data"]
    params = capture(spec.step_fn, *args).role_bytes(Role.PARAM)
    assert reduced < params + table / 2  # each gradient once, the table not twice


def test_zero3_reduce_scatters_a_tied_tables_two_gradient_parts_apart():
    # Under ZeRO-3 the GPU does not add the tied word table's two gradient parts before
    # reducing them, as it does for an all-reduce: it reduce-scatters each (the HLO holds
    # two f32[1024,128] reduce-scatters), one table's bytes (-19%) more than priced when
    # the reassociation was taken to hold here too (`Tables.tied_partial`).
    spec = get_model(
        "bert-base", layers=2, hidden=128, heads=4, seq=64, batch=16, vocab=1024, dtype="float32"
    )
    args = spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.expert_plans(spec.step_fn, *args, cluster=a100)["zero3"]
    report = verify(spec.step_fn, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    params = capture(spec.step_fn, *args).role_bytes(Role.PARAM)
    assert report.xla_comm_bytes["reduce-scatter@data"] > params + 1024 * 128 * 4 / 2


@pytest.mark.slow  # a one-stage pipeline's programs compiled for 8 A100s
def test_an_accumulating_step_reduces_a_tied_tables_two_gradient_sums_apart():
    # One stage, two microbatches: the runtime sums each op's gradient over the
    # microbatches apart and reduces the sums in a program of its own, where the tied
    # table's two sums are two arguments XLA all-reduces as they are (one table's bytes,
    # 23% of the step's gradients, priced as one when one program made both).
    spec = get_model(
        "bert-base", layers=2, hidden=128, heads=4, seq=64, batch=16, vocab=1024, dtype="float32"
    )
    args = spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=8)
    plan = am.plan_recipe(spec.step_fn, *args, recipe=am.Recipe(dp=8, microbatches=2), cluster=a100)
    assert len(plan.stages) == 1
    report = verify(spec.step_fn, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    params = capture(spec.step_fn, *args).role_bytes(Role.PARAM)
    assert report.xla_comm_bytes["all-reduce@data (stage 0)"] > params + 1024 * 128 * 4 / 2


def test_compile_only_gpus_say_what_they_cannot_do():
    assert 'device_description_str: "NVIDIA A100-SXM4-80GB"' in target_config("a100")
    with pytest.raises(ApplyError, match="no compile-only description of GPU 'v100'"):
        gpu_devices("v100", 8)
    with pytest.raises(ApplyError, match="whole nodes of 8"):
        gpu_devices("a100", 12)
    assert len(gpu_devices("h100", 16)) == 16


def _bf16_gpt():
    spec = get_model("gpt-1.3b", layers=4, hidden=128, heads=8, seq=128, batch=16, vocab=512,
                     dtype="bfloat16", softmax="fused")  # fmt: skip
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


@pytest.mark.slow  # a pipeline compiled for 8 A100s
def test_a_pipeline_compiled_for_a_gpu_holds_what_its_stages_are_priced():
    # Megatron's recipe on a bfloat16 GPT, as the published table's rows run it: every
    # stage's programs compiled for A100s, stage by stage. Each stage sums its
    # microbatches' 16-bit weight gradients once per step in 16 bits, as Megatron-LM's
    # runs do (`jnp.sum` would sum them in float32: twice the bytes; the CPU, which runs
    # 16-bit collectives in float32, cannot tell).
    step, args = _bf16_gpt()
    a100 = am.Cluster.preset("a100", devices=8)
    recipe = am.Recipe(pp=4, dp=2, microbatches=8, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    for s in range(4):
        grads = report.xla_comm_bytes[f"all-reduce@data (stage {s})"]
        assert grads > 200_000  # the gradients, not a loss scalar
    assert report.xla_flops is None and report.numerics_ok is None  # compiled, never run
    assert "(8 compile-only a100 GPUs)" in report.summary()
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.15)


@pytest.mark.slow  # a pipeline's programs compiled for 2 A100s (~40 s on two cores)
def test_a_pipeline_stage_holds_each_weights_16_bit_cast_once():
    # Wide layers and a short sequence, so the weights' bf16 casts (made once a step,
    # before the microbatches) are a sixth of a stage's memory. A stage's B program reads
    # the runtime's one copy of each as an argument (`_run/_segments.py`: an F hands its
    # B only what it made). Priced a second time as a residual, the stages were 1.08x and
    # 1.16x XLA's A100 programs; once, both within 1%.
    spec = get_model("gpt-1.3b", layers=2, hidden=512, heads=8, batch=8, seq=16, vocab=64,
                     dtype="bfloat16", positions="learned")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=2)
    recipe = am.Recipe(pp=2, microbatches=2, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args, target="a100")
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.03)


def test_automap_verify_compiles_for_a_gpu(tmp_path, monkeypatch):
    # The weight gradient is a partial sum over the batch split, all-reduced on "data" on
    # the GPU as on the CPU.
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    path = plan.save(tmp_path / "plan.json")
    out = CliRunner().invoke(app, ["verify", str(path), "--target", "a100", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["xla_comm_bytes"] == {"all-reduce@data": 32 * 4 * 4}
    assert report["xla_memory_bytes"] > 0 and report["xla_flops"] is None
    out = CliRunner().invoke(app, ["verify", str(path), "--target", "a100", "--numerics"])
    assert out.exit_code != 0 and "--target only compiles" in out.output


@pytest.mark.slow  # compiled for 16 A100s (about a minute)
def test_zero2_of_a_mixed_precision_step_gathers_bf16_copies_like_deepspeed():
    # ZeRO-1/2 keeps a bf16 step's float32 masters on shards and gathers the casts the
    # model computes with (`Plan.zero_gather`): the GPU's all-gather of the weights is
    # bf16, priced to the byte, and the step costs about what data parallel's does.
    # bert-large of 2 layers (full width, seq 512) over 16 A100s: priced 24.8 ms against
    # data parallel's 26.4; all 24 layers compile in minutes: 114.7 ms against 122.1
    # (gathering float32 weights, 143.1), the collectives matching XLA's there too.
    spec = get_model("bert-large", layers=2)
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = am.Cluster.preset("a100", devices=16)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=16, zero=2), cluster=a100)
    assert plan.zero_gather == "compute"
    compiled = compile_plan(step, plan, args, target="a100")  # verify reads it too, below
    text = compiled[1].as_text()
    gathers = [line for line in text.splitlines() if re.search(r"= .*all-gather-start\(", line)]
    # the weights' gather is bf16; LayerNorm's float32 scales and biases go apart
    shapes = re.findall(r"(\w+)\[\d+,\d+\]", " ".join(gathers))
    assert shapes and set(shapes) == {"bf16"}
    # The tied word table, read through two casts (the lookup's and the MLM head's), is
    # gathered once (it was twice, 62.5 MB more than DeepSpeed's one gather).
    graph = capture(step, *args)
    groups = build_groups(graph)
    (tied,) = [
        t for t, c in narrow_params(graph, zero_region(graph, groups)[1]).items() if len(c) > 1
    ]
    whole = "bf16[" + ",".join(map(str, graph.tensors[tied].shape)) + "]"
    assert " ".join(gathers).count(whole) == 1, whole
    report = verify(step, plan, *args, target="a100", compiled=compiled)
    assert report.collectives_match, report.mismatches
    dp = am.plan_recipe(step, *args, recipe=am.Recipe(dp=16), cluster=a100)
    model = CostModel(graph, a100)
    assert model.estimate(plan).step_time_s < 1.05 * model.estimate(dp).step_time_s


def test_an_h200_is_compiled_for_as_the_h200_it_is(tmp_path, monkeypatch):
    # The H200 preset's plans are held against XLA compiling for an H200 (its memory and
    # L2 as a lent one reported them), not for the H100 whose die it shares: the device
    # XLA plans with says so, and the plan is priced by the h200 preset.
    device = gpu_devices("h200", 8)[0]
    assert device.device_kind == "NVIDIA H200"
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    out = CliRunner().invoke(
        app, ["verify", str(plan.save(tmp_path / "p.json")), "--target", "h200", "--json"]
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["target"] == "h200" and report["collectives_match"]
    assert report["xla_comm_bytes"] == {"all-reduce@data": 32 * 4 * 4}


@pytest.mark.slow  # one program compiled for an A100 and for an H100: ~40 s on two cores
def test_attention_and_gelu_residuals_are_kept_as_each_gpu_keeps_them():
    # A bfloat16 GPT without recomputation, its softmax in float32: XLA keeps the scores'
    # matmul output (the division by sqrt(d) is a multiply it fuses into each reader), and
    # GELU's tanh in float32 on an A100, whose bfloat16 adds and multiplies run in float32,
    # but in bfloat16 on an H100, whose do not. Priced with the tanh and the scaled scores
    # kept in float32 on both, the H100 plan was 1.26x XLA's buffers and the A100's 1.12x
    # (the full-size gpt-1.3b, batch 4: 77.5 GB priced, 61.4 GB compiled for an H100,
    # 62.0 GB measured on an H200).
    spec = get_model("gpt-1.3b", layers=2, hidden=128, heads=8, seq=512, batch=4, vocab=512,
                     dtype="bfloat16")  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    for gpu in ("a100", "h100"):
        cluster = am.Cluster.preset(gpu, devices=1)
        plan = am.plan_recipe(step, *args, recipe=am.Recipe(remat="none"), cluster=cluster)
        report = verify(step, plan, *args, target=gpu)
        assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.05)


@pytest.mark.slow  # compiled for 8 A100s
def test_a_gpu_recomputes_a_layer_before_the_norm_backward_that_precedes_its_first_read():
    # Under full recomputation XLA's A100 schedule makes a layer's residuals again just
    # after the backward's last matmul before their first read, before the next layer's
    # norm backward kernel, which reads that layer's all-reduced cotangent
    # (`Lowering.early_recompute`; read on test_seqpar's 2-layer GPT at tp 8). A second
    # program, 3 layers at tp 4 x dp 2: priced 0.94x XLA's buffer assignment, 0.87x with
    # each recompute at its first read.
    spec = get_model(
        "gpt-1.3b", layers=3, hidden=512, heads=8, batch=8, seq=512, vocab=512,
        dtype="bfloat16", positions="learned", softmax="fused",
    )  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = am.Cluster.preset("a100", 8)
    assert a100.lowering.early_recompute
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=4, dp=2, remat="full"), cluster=a100)
    held = compiled_memory(compile_plan(step, plan, args, target="a100")[1])
    assert plan.predicted.memory_bytes == pytest.approx(held, rel=0.1)
    late = am.estimate(step, *args, plan=plan, cluster=a100.with_lowering(early_recompute=False))
    assert late.memory_bytes < 0.9 * held
