"""verify: XLA's collectives read back, compared with the cost model; numerics checked."""

import dataclasses
import textwrap
import warnings

import jax
import numpy as np
import pytest

import automap as am
from automap import ApplyError, Cluster, Plan, PlanError
from automap._capture import capture
from automap._cost import CostModel
from automap._groups import build_groups
from automap._pipeline import Phase, pipeline_plan, uniform_cuts
from automap._plan import Provenance, Stage
from automap._run import apply_pipeline
from automap._space import batch_groups, block_groups
from automap._verify import (
    VerifyReport,
    as_on_cpu,
    compare_collectives,
    compile_plan,
    compiled_flops,
    verify,
    verify_in_subprocess,
    xla_counted_flops,
)
from automap._zoo import get_model
from pipeline._models import zoo
from test_apply import megatron_rule, mlp_args, mlp_step, specs_for


def test_compare_rules():
    assert compare_collectives({}, {}) == (True, [])
    same = {"all-reduce@data": 1000.0}
    assert compare_collectives(same, {"all-reduce@data": 1040.0})[0]  # within 5%
    ok, why = compare_collectives(same, {"all-reduce@data": 1100.0})
    assert not ok and "all-reduce over data: predicted" in why[0] and "-9.1%" in why[0]
    # Under 1% of all traffic is trivial on either side; above it, absence is a mismatch.
    assert compare_collectives(same, {"all-reduce@data": 1000.0, "all-reduce@model": 9.0})[0]
    ok, why = compare_collectives(same, {"all-reduce@data": 1000.0, "all-gather@model": 50.0})
    assert not ok and why == ["XLA inserts all-gather over model (50 B) that the cost model misses"]
    ok, why = compare_collectives({**same, "all-to-all@data+model": 2048.0}, same)
    assert not ok and "predicts all-to-all over data+model (2.00 KiB); XLA has none" in why[0]


def test_reduce_scatter_compared_as_cpu_all_reduce():
    # XLA's CPU backend all-reduces and slices where a GPU reduce-scatters: same bytes.
    predicted = {"reduce-scatter@data": 100.0, "all-reduce@data": 50.0, "all-gather@model": 7.0}
    assert as_on_cpu(predicted) == {"all-reduce@data": 150.0, "all-gather@model": 7.0}


def test_report_round_trip_and_summary():
    report = VerifyReport(
        mesh={"data": 2, "model": 4},
        collectives_match=False,
        predicted_comm_bytes={"all-reduce@data": 4096.0},
        xla_comm_bytes={"all-reduce@data": 2048.0, "all-gather@model": 10.0},
        mismatches=("all-reduce over data: predicted 4.00 KiB, XLA 2.00 KiB (+100.0%)",),
        notes=("a caveat",),
        numerics_ok=True,
        max_abs_err=1e-7,
    )
    assert VerifyReport.from_dict(report.to_dict()) == report
    text = report.summary()
    assert "DO NOT MATCH" in text and "all-gather@model" in text and "numerics" in text
    assert "mesh data=2 × model=4 (8 CPU devices)" in text and "note: a caveat" in text


@pytest.mark.slow  # plans compiled and run
def test_verify_mlp_concrete():
    args = mlp_args()
    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs_for(args, megatron_rule("data", "model")))
    report = verify(mlp_step, plan, *args)
    # Row-parallel partial sums over "model", gradients over "data"; biases replicated on
    # "model" add their gradient all-reduce too. The exact split is XLA's; the axes are not.
    assert set(report.xla_comm_bytes) == {"all-reduce@data", "all-reduce@model"}
    assert report.xla_comm_bytes["all-reduce@model"] >= 16 * 16 * 4 / 2
    assert report.numerics_ok is True and report.max_abs_err < 1e-5
    assert report.collectives_match in (True, False) and report.predicted_comm_bytes
    assert "collectives:" in report.summary()


def test_verify_abstract_args_allocate_nothing_and_skip_numerics():
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_args())
    plan = Plan(mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)))
    report = verify(mlp_step, plan, *args)
    assert report.numerics_ok is None and report.max_abs_err is None
    assert list(report.xla_comm_bytes) == ["all-reduce@data"]
    params_bytes = (32 * 64 + 64 + 64 * 16 + 16) * 4
    assert params_bytes <= report.xla_comm_bytes["all-reduce@data"] <= params_bytes + 64


def test_verify_reads_the_executable_it_is_handed_rather_than_compiling_again():
    # A caller that compiled the plan to read its program hands verify that executable:
    # the report is the one verify makes compiling it, and it is that executable verify
    # reads (a data-parallel plan's program handed in under a Megatron plan's mesh shape
    # reports the data-parallel program's collectives). Anything else is one line.
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_args())
    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs_for(args, megatron_rule("data", "model")))
    compiled = compile_plan(mlp_step, plan, args)
    assert verify(mlp_step, plan, *args, compiled=compiled) == verify(mlp_step, plan, *args)
    data_only = dataclasses.replace(plan, specs=specs_for(args, megatron_rule("data", None)))
    other = verify(mlp_step, plan, *args, compiled=compile_plan(mlp_step, data_only, args))
    assert set(other.xla_comm_bytes) == {"all-reduce@data"} and not other.collectives_match
    eight = Plan(mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)))
    with pytest.raises(ApplyError, match=r"compiled for a mesh \{'data': 2, 'model': 4\}"):
        verify(mlp_step, eight, *args, compiled=compiled)
    with pytest.raises(ApplyError, match=r"not for this plan's .* on target 'a100'"):
        verify(mlp_step, plan, *args, target="a100", compiled=compiled)
    with pytest.raises(ApplyError, match=r"the \(prepared, executable\) pair compile_plan"):
        verify(mlp_step, plan, *args, compiled=compiled[1])
    # A plan with no mesh axes runs on one device, on a mesh of one placeholder axis: its
    # own compiled pair is accepted.
    whole = Plan(mesh={}, specs=specs_for(args, lambda path, x: (None,) * x.ndim))
    alone = verify(mlp_step, whole, *args, compiled=compile_plan(mlp_step, whole, args))
    assert alone.collectives_match and not alone.xla_comm_bytes


def test_verify_needs_enough_cpu_devices():
    args = mlp_args()
    plan = Plan(mesh={"data": 16}, specs=specs_for(args, megatron_rule("data", None)))
    with pytest.raises(ApplyError, match=r"16 CPU devices.*has 8.*`automap verify plan\.json`"):
        verify(mlp_step, plan, *args)
    with pytest.raises(ApplyError) as info:  # a public way out, not a private function
        verify(mlp_step, plan, *args)
    assert "automap._" not in str(info.value)


def test_verify_checks_pipeline_plans_like_apply():
    # Pipeline plans are run and compared (tests/pipeline/test_runtime.py); a plan for
    # other inputs is refused as apply refuses it.
    stages = (Stage(0, 1, (0,), {"data": 1}), Stage(1, 2, (1,), {"data": 1}))
    plan = Plan(mesh={"pipe": 2, "data": 1}, specs={}, stages=stages)
    with pytest.raises(PlanError, match="do not match the plan"):
        verify(mlp_step, plan, *mlp_args())
    with pytest.raises(ApplyError, match="takes one program, but a pipeline plan runs several"):
        verify(mlp_step, plan, *mlp_args(), compiled=object())


def tiny_fn_plan(tmp_path, monkeypatch) -> Plan:
    """A plan on data 4 x model 4 for a --fn target a verify child can import from the
    working directory (`tmp_path`): it rebuilds the step from the plan's provenance."""
    (tmp_path / "tiny_step.py").write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            def step(w, x):
                g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
                return w - 0.1 * g

            def make():
                return step, (jax.ShapeDtypeStruct((32, 16), jnp.float32),
                              jax.ShapeDtypeStruct((64, 32), jnp.float32))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    return Plan(
        mesh={"data": 4, "model": 4},
        specs={"[0]": (None, "model"), "[1]": ("data", None)},
        provenance=Provenance(fn="tiny_step:make"),
    )


def test_verify_in_subprocess_with_more_devices(tmp_path, monkeypatch):
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    report = verify_in_subprocess(plan, timeout=120)
    assert report.mesh == {"data": 4, "model": 4}
    # The weight gradient is a partial sum over the batch split: one all-reduce on "data".
    assert report.xla_comm_bytes["all-reduce@data"] == pytest.approx(32 * 4 * 4)
    assert np.isclose(sum(report.xla_comm_bytes.values()), 32 * 4 * 4)


def test_zoo_step_in_16_bit_compared_as_the_cpu_moves_it():
    from automap._zoo import get_model

    model = get_model("mlp", dtype="bfloat16", layers=1, hidden=64)
    args = model.abstract_args()

    def batch_on_data(path, x):
        split = path.startswith("[2]") and x.ndim > 0
        return ("data",) * split + (None,) * (x.ndim - split)

    plan = Plan(mesh={"data": 8}, specs=specs_for(args, batch_on_data))
    report = verify(model.step_fn, plan, *args, cluster=Cluster.preset("a100", devices=8))
    # Float32 parameters' gradients: XLA all-reduces them whatever the compute dtype.
    params = sum(x.size for x in jax.tree_util.tree_leaves(args[0])) * 4
    assert params <= report.xla_comm_bytes["all-reduce@data"] <= params * 1.01
    # An a100 cluster, asked for the CPU's collective lowering.
    assert report.collectives_match, report.summary()


@pytest.mark.slow  # plans compiled
def test_verify_reports_memory_next_to_xlas_buffer_assignment():
    # A Megatron plan of a small GPT: parameters, Adam state and activations split on the
    # model axis; the cost model's peak and XLA's buffer assignment agree within 15%.
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128,
                     dtype="float32")  # fmt: skip
    args = spec.abstract_args()
    plans = am.expert_plans(spec.step_fn, *args, cluster=am.Cluster.preset("a100", devices=8))
    report = verify(spec.step_fn, plans["megatron"], *args)
    assert report.xla_memory_bytes > 0 and report.predicted_memory_bytes > 0
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    assert "memory per device: predicted" in report.summary()
    # XLA's CPU gives no live peak in the TPU's sense: none is read or shown
    assert report.xla_live_peak_bytes is None and "live peak" not in report.summary()


@pytest.mark.slow  # a two-stage GPT compiled: ~20 s on two cores
def test_pipeline_memory_holds_the_microbatch_gradients_the_cpu_holds():
    # Megatron's recipe on a reduced GPT (tp 2 x pp 2 x dp 2, full recomputation, 4
    # microbatches). XLA's CPU B program writes the weight gradients its matmuls make to
    # buffers of their own and adds them into the running sums at its end, where a GPU's
    # GEMM adds them inside the matmul: verify's CPU pricing holds them (stage 0 was 0.79x
    # without), an a100's does not.
    spec = get_model("gpt-1.3b", layers=4, hidden=128, heads=8, seq=128, batch=8, vocab=512,
                     dtype="float32", softmax="fused")  # fmt: skip
    args = spec.abstract_args()
    a100 = Cluster.preset("a100", devices=8)
    recipe = am.Recipe(tp=2, pp=2, dp=2, remat="full", microbatches=4)
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1))  # its update in place, as priced
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
    report = verify(step, plan, *args)
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.15), report.summary()
    # XLA's breakdown (of the stage predicted largest) accounts for that stage's figure:
    # its programs' sizes and what the runtime holds between them.
    largest = max(range(2), key=lambda s: report.stage_memory_bytes[s][0])
    parts = report.xla_memory_breakdown
    assert sum(parts.values()) >= report.stage_memory_bytes[largest][1] * (1 - 1e-9)
    assert f"stage predicted largest ({largest})" in report.summary()
    held = a100.with_lowering(matmul_accumulates=False)
    on_cpu = am.estimate(step, *args, plan=plan, cluster=held).memory_bytes
    assert on_cpu > plan.predicted.memory_bytes


@pytest.mark.parametrize("expert", ["data_parallel", "zero1", "zero3"])
def test_memory_holds_the_gradients_and_the_copy_the_cpus_all_reduce_writes(expert):
    # The zoo MLP on data=8, its gradients far larger than its activations. XLA's CPU
    # all-reduces the gradients synchronously into buffers of their own (with ZeRO too:
    # it all-reduces and slices), so at the end of the backward its temporaries are the
    # local gradients and their reduced copy: verify's CPU pricing has that second peak.
    # A GPU's combined all-reduce copies them too (their concatenation, which it reduces),
    # where ZeRO's reduce-scatter writes only the device's shards (`busiest_moment`).
    spec = get_model("mlp")
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    a100 = Cluster.preset("a100", devices=8)
    plan = am.expert_plans(step, *args, cluster=a100)[expert]
    report = verify(step, plan, *args)
    grads = capture(step, *args).role_bytes(am.Role.PARAM)
    temporaries = report.xla_memory_breakdown["temporaries"]
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    if expert == "zero3":
        # ... but ZeRO-3 reduces them layer by layer (`_fsdp.py`): the largest layer's and
        # its copy at once, and the shards of the rest (1.26x the gradients, not 2x).
        assert temporaries < 1.3 * grads
        assert report.predicted_memory_breakdown["grads"] < 1.4 * grads
    else:
        assert temporaries == pytest.approx(2 * grads, rel=0.02)
        assert report.predicted_memory_breakdown["grads"] == pytest.approx(2 * grads)
    if expert != "zero3":  # whose busiest moment is the backward's, parameters gathered
        copy = 1.0 if expert == "data_parallel" else 1 / 8
        assert plan.predicted.memory_breakdown["grads"] == pytest.approx((1 + copy) * grads)
    if expert == "data_parallel":
        # XLA's combiner joins at most a bucket (30 MiB by default): at scale the copy is a
        # bucket, not the gradients.
        bucket = a100.with_lowering(all_reduce_combine_bytes=4096.0)
        cost = am.estimate(step, *args, plan=plan, cluster=bucket)
        assert cost.memory_breakdown["grads"] == pytest.approx(grads + 4096.0)


def _replicated(path, x):
    return (None,) * x.ndim


@pytest.mark.slow  # plans compiled
def test_verify_reports_flops_next_to_xlas_cost_analysis():
    # FLOPs per device: the cost model's (every op / the divisor of its iteration space)
    # against XLA's cost analysis of the partitioned program, on two plans whose counts
    # are 8x apart: the batch split over 8 devices, and the same mesh with nothing split.
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_args(batch=256))
    split = Plan(mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)))
    whole = Plan(mesh={"data": 8}, specs=specs_for(args, _replicated))
    a, b = verify(mlp_step, split, *args), verify(mlp_step, whole, *args)
    for report in (a, b):
        assert report.predicted_flops == report.predicted_flops_as_xla  # no loop, no conv
        assert report.predicted_flops_as_xla == pytest.approx(report.xla_flops, rel=0.15)
        assert "FLOPs per device per step: predicted" in report.summary()
    # The comparison can fail: one plan's prediction is far from the other's compiled count.
    assert b.xla_flops > 4 * a.xla_flops
    assert a.predicted_flops != pytest.approx(b.xla_flops, rel=0.15)
    assert VerifyReport.from_dict(a.to_dict()) == a


def test_flops_counted_as_xla_counts_loops_and_padded_convolutions():
    # XLA's CPU cost analysis counts a while body once and only the kernel taps that meet
    # the input; the graph counts what runs (the body times its trips) and padding as data:
    # per spatial dim 6 outputs x 3 taps, of which 2 fall on the padding.
    w = jax.ShapeDtypeStruct((32, 32), np.float32)
    x = jax.ShapeDtypeStruct((8, 32), np.float32)

    def scan10(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=10)[0]

    image = jax.ShapeDtypeStruct((2, 3, 6, 6), np.float32)  # NCHW, 3x3 kernel, SAME
    kernel = jax.ShapeDtypeStruct((4, 3, 3, 3), np.float32)

    def conv(img, k):
        return jax.lax.conv_general_dilated(img, k, (1, 1), "SAME")

    for fn, fargs, graph_over_xla in (
        (scan10, (x, w), 10.0),
        (conv, (image, kernel), (18 / 16) ** 2),
    ):
        g = capture(fn, *fargs)
        (op,) = [op for op in g.ops if op.flops > 0]
        xla = compiled_flops(jax.jit(fn).lower(*fargs).compile())
        assert xla_counted_flops(g, op) == pytest.approx(xla, rel=0.01)
        assert op.flops == pytest.approx(graph_over_xla * xla, rel=0.01)


@pytest.mark.slow  # two pipelines of a GPT compiled: ~30 s on two cores
def test_verify_reports_pipeline_memory_and_flops_per_stage():
    # A tiny GPT in two stages on data=2 x model=2 each, 4 microbatches in 1F1B: per stage,
    # the pipeline cost model's peak memory and FLOPs against XLA's programs of that stage.
    spec, graph, groups = zoo("gpt2-xl")
    args = spec.abstract_args()
    cuts = uniform_cuts(graph, groups, 2)
    mesh = {"data": 2, "model": 2}
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    plan = pipeline_plan(graph, groups, cuts, mesh, assignment, 4, "1f1b")
    # A training loop donates the old state: the update runs in place, as the model prices.
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1))
    plain = verify(step, plan, *args)
    remat = verify(step, dataclasses.replace(plan, remat=True), *args)
    assert "stage 1: memory predicted" in plain.summary()
    for s in range(2):
        (pm, xm), (_, pf, xf) = plain.stage_memory_bytes[s], plain.stage_flops[s]
        assert pm == pytest.approx(xm, rel=0.15), plain.summary()
        assert pf == pytest.approx(xf, rel=0.15), plain.summary()
        # Remat recomputes each stage's layers in its backward: XLA's programs run more
        # FLOPs and hold less, and the model says so; a model that forgot the recompute
        # would be off by more than the tolerance.
        (rm, rxm), (_, rf, rxf) = remat.stage_memory_bytes[s], remat.stage_flops[s]
        assert rf == pytest.approx(rxf, rel=0.15), remat.summary()
        assert rm == pytest.approx(rxm, rel=0.15), remat.summary()
        assert pf != pytest.approx(rxf, rel=0.15)
        # The runtime's peak (run.memory) of the last stage (one microbatch in flight) can
        # be its update, where remat saves nothing: never more, less on the first.
        assert rxf > xf and rxm <= xm and rm < pm
    assert remat.stage_memory_bytes[0][1] < plain.stage_memory_bytes[0][1]


def test_verify_splits_memory_into_its_parts_and_names_a_step_that_donates_nothing():
    # The stored state (parameters, Adam's moments, the batch split on "data") is XLA's
    # arguments, byte for byte; the rest of each side is what the step makes. A step that
    # donates nothing has XLA hold its outputs apart: a note says so.
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_args(batch=64))
    plan = Plan(mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)))
    plain = verify(mlp_step, plan, *args)
    donated = verify(jax.jit(mlp_step, donate_argnums=(0, 1)), plan, *args)
    for report in (plain, donated):
        p, x = report.predicted_memory_breakdown, report.xla_memory_breakdown
        stored = p["params"] + p["opt_state"] + p["other"]
        assert stored == pytest.approx(x["arguments"], rel=0.01), report.summary()
        assert p["opt_state"] == pytest.approx(2 * p["params"], abs=16)  # Adam's moments
    assert any("donates no input" in n for n in plain.notes)
    assert plain.xla_memory_breakdown["aliased"] == 0
    assert not any("donates" in n for n in donated.notes)
    assert donated.xla_memory_breakdown["aliased"] > 0.9 * plain.xla_memory_breakdown["outputs"]
    assert donated.xla_memory_bytes < plain.xla_memory_bytes


def test_the_outputs_held_apart_are_those_xla_does_not_alias():
    # JAX aliases each donated input to the first output of its shape and dtype not yet
    # taken, then to one of its size (a transpose's); XLA writes that output over the
    # input. The cost model holds the rest apart (`_cost/_outputs.py`): XLA's outputs less
    # what it aliases, a float32 argument that matches no output donated in vain.
    def step(a, b, c):
        return a * 2, (b + 1).T, c.sum(), a + 1

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    args = (f32(256, 64), f32(64, 256), f32(4096))
    cpu = Cluster.preset("cpu", devices=1)
    held = []
    for donated in [(), (0,), (0, 1), (0, 1, 2)]:
        fn = jax.jit(step, donate_argnums=donated)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "some donated buffers were not usable": c's
            stats = fn.lower(*args).compile().memory_analysis()
            graph = capture(fn, *args, roles={2: "batch"})
        held.append(CostModel(graph, cpu).tables.output_coef.sum())
        apart = stats.output_size_in_bytes - stats.alias_size_in_bytes
        assert held[-1] == pytest.approx(apart, rel=1e-3)  # but XLA's tuple of pointers
    assert held == [3 * 65536 + 4, 2 * 65536 + 4, 65536 + 4, 65536 + 4]


@pytest.mark.parametrize("expert", ["data_parallel", "megatron"])
def test_a_step_that_donates_nothing_holds_its_new_state_at_its_update(expert):
    # The zoo MLP (its state far larger than its activations), its step jitted without
    # and with donate_argnums, compiled on the CPU. Without, XLA writes the new parameters
    # and moments beside the old ones: its update is the peak, where each gradient it
    # reads is written over by a new value of its shape (`_cost/_model.update_peak`);
    # priced in place data parallel was 0.79x XLA's figure. With, the update runs in place.
    spec = get_model("mlp")
    args = spec.abstract_args()
    a100 = Cluster.preset("a100", devices=8)
    for step in (spec.step_fn, jax.jit(spec.step_fn, donate_argnums=(0, 1))):
        plan = am.expert_plans(step, *args, cluster=a100)[expert]
        report = verify(step, plan, *args)
        assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
        held = report.predicted_memory_breakdown["outputs"]
        if step is spec.step_fn:
            assert held == pytest.approx(report.xla_memory_breakdown["outputs"], rel=0.01)
            in_place = report.predicted_memory_bytes - held
            assert in_place < 0.85 * report.xla_memory_bytes, report.summary()
            assert any("the cost model prices them so" in n for n in report.notes)
        else:
            assert held < 1e-3 * report.predicted_memory_bytes  # the loss alone


def test_a_pipeline_that_donates_nothing_holds_each_stages_new_state():
    # The MLP in two stages of data=4, four microbatches: the runtime's post programs
    # donate what the step donates. Without donation each stage keeps its new state beside
    # the old until the step returns ("outputs"), where the donating step's stage peaks at
    # its backward or its reduce program: per stage, the model against run.memory (XLA's
    # programs and what the runtime holds between them), 0.72x priced in place.
    spec = get_model("mlp")
    args = spec.abstract_args()
    a100 = Cluster.preset("a100", devices=8)
    recipe = am.Recipe(pp=2, dp=4, microbatches=4)
    reports = []
    for step in (spec.step_fn, jax.jit(spec.step_fn, donate_argnums=(0, 1))):
        plan = am.plan_recipe(step, *args, recipe=recipe, cluster=a100)
        report = verify(step, plan, *args)
        for predicted, xla in report.stage_memory_bytes:
            assert predicted == pytest.approx(xla, rel=0.15), report.summary()
        reports.append(report)
    plain, donated = reports
    held = plain.predicted_memory_breakdown["outputs"]
    assert held > 0 and donated.predicted_memory_breakdown["outputs"] == 0
    largest = max(plain.stage_memory_bytes)
    assert largest[0] - held < 0.85 * largest[1]
    for (p, x), (dp, dx) in zip(plain.stage_memory_bytes, donated.stage_memory_bytes, strict=True):
        assert p > dp and x > dx


def test_verify_runs_a_donating_step_on_copies_of_concrete_arguments():
    # A training loop's step donates its state; verify runs it (and the unsharded step
    # it compares with) more than once, so each run gets buffers of its own, and the
    # caller's arguments are left as they were.
    args = mlp_args(batch=64)
    before = jax.tree.map(np.array, args)
    plan = Plan(mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)))
    report = verify(jax.jit(mlp_step, donate_argnums=(0, 1)), plan, *args)
    assert report.numerics_ok, report.summary()
    for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def wide_mlp_pipeline(dtype: str):
    """(step, args, plan): a wide MLP cut after its hidden layer's ReLU, two stages of data
    4, one microbatch: stage 1 sends back the [512, 4096] gradient of that activation."""
    spec = get_model("mlp", layers=1, hidden=4096, features=64, batch=512, dtype=dtype)
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = capture(step, *args)
    groups = build_groups(graph)
    assignment = {g.id: "data" for g in batch_groups(groups)}
    second = [op.index for op in graph.ops if op.primitive == "dot_general"][1]
    plan = pipeline_plan(graph, groups, (second,), {"data": 4}, assignment, 1, "gpipe")
    return step, args, plan


def test_a_stage_backward_holds_the_gradient_it_receives_while_it_runs():
    # Stage 0's B program takes the gradient stage 1 sends back (a quarter of [512, 4096]
    # float32 a device) as an argument, alive while B runs: the runtime donates a B
    # program nothing. Priced without it, stage 0 was 0.75 of XLA's.
    step, args, plan = wide_mlp_pipeline("float32")
    report = verify(step, plan, *args)
    (priced, xla), _ = report.stage_memory_bytes
    assert priced == pytest.approx(xla, rel=0.15), report.summary()
    received = 512 * 4096 * 4 / 4
    programs = apply_pipeline(step, plan).compile(*args)
    (b0,) = [p for p in programs if p.stage == 0 and p.kind is Phase.BWD]
    assert "f32[128,4096]" in b0.compiled.as_text().split("ENTRY", 1)[1].split("\n", 1)[0]
    assert b0.compiled.memory_analysis().argument_size_in_bytes >= received
    assert priced - received < 0.85 * xla
