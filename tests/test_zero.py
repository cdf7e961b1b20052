"""ZeRO-1/2/3 as XLA compiles it: gradients reduce-scattered (on the CPU: all-reduced and
sliced), the Adam update on shards, parameters all-gathered once (ZeRO-1/2) or, with
ZeRO-3, where the forward uses them and again where the backward does (FSDP); the cost
model prices that program's collectives and memory, and the step computes what the plain
step does."""

import dataclasses
import functools
import re
import warnings

import pytest

import automap as am
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._errors import PlanError
from automap._graph import Role
from automap._groups import (
    build_groups,
    narrow_params,
    plan_from_assignment,
    regather_plan,
    repeated_casts,
    zero_mismatch,
    zero_region,
)
from automap._verify import comm_bytes, compile_plan, parse_collectives, verify
from automap._zoo import get_model
from pipeline._models import flax_args, flax_step

MESH = {"data": 8}


@functools.cache
def gpt(dtype: str = "bfloat16"):
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128,
                     dtype=dtype)  # fmt: skip
    args = spec.concrete_args() if dtype == "float32" else spec.abstract_args()
    g = capture(spec.step_fn, *args)
    return spec, args, g, build_groups(g)


def zero_plan(stage: int, dtype: str = "bfloat16"):
    _, _, g, groups = gpt(dtype)
    return plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=stage)


@functools.cache
def compiled(stage: int):
    spec, args, g, _ = gpt()
    return compile_plan(spec.step_fn, zero_plan(stage), args, graph=g)[1]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_compiles_reduce_scatter_and_a_sharded_update(stage):
    spec, args, g, groups = gpt()
    plan = zero_plan(stage)
    text = compiled(stage).as_text()
    xla = comm_bytes(parse_collectives(text), MESH)
    cpu = Cluster.preset("cpu", devices=8)
    dp = CostModel(g, cpu, groups).evaluate({groups.batch_groups[0]: "data"}, MESH)
    # The gradients' reduction moves what data parallel's does (the CPU lowers a
    # reduce-scatter as an all-reduce of the same buffer and a slice of it) ...
    assert xla["all-reduce@data"] == pytest.approx(dp.collectives[0].bytes, rel=0.01)
    assert "dynamic-slice" in text
    # ... and the parameters are gathered (not the Adam moments as well): once (ZeRO-1/2
    # of this bf16 step gathers the casts, the CPU widening them to float32: the tied
    # embedding's two, the lookup's and the head's, in one gather), or with ZeRO-3 by
    # each layer that reads them (the tied embedding by the first and the head) and once
    # more for the backward (all but the biases, which it does not read).
    gathered = xla["all-gather@data"] / g.role_bytes(Role.PARAM)
    assert (gathered == pytest.approx(1.0, rel=0.01)) if stage < 3 else (1.9 < gathered < 2.1)
    assert set(xla) == {"all-reduce@data", "all-gather@data"}
    # The update runs on shards: its Adam arithmetic reads 1/8 of a kernel's moments.
    assert re.search(r"sqrt[^\n]*f32\[8,256\]", text)
    assert not re.search(r"sqrt[^\n]*f32\[64,256\]", text)
    # The cost model prices that program: collectives and peak memory.
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)


@pytest.mark.slow  # ZeRO plans compiled and run
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_plans_compute_what_the_plain_step_does(stage):
    spec, args, _, _ = gpt("float32")  # bf16 sums differ with their order, ZeRO or not
    report = verify(spec.step_fn, zero_plan(stage, "float32"), *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok, report.summary()


def test_zero3_gathers_each_parameter_again_for_the_backward_and_keeps_no_copy():
    # FSDP: the forward's gathered copies die in the forward; the backward gathers the
    # parameters it reads once more, each after its layer's gradient arrives.
    _, _, g, groups = gpt()
    rg = regather_plan(g, groups)
    again = sum(g.tensors[t].nbytes for t in rg.params)
    text = compiled(3).as_text()
    gathers = [c for c in parse_collectives(text) if c.kind == "all-gather"]
    leaves = [leaf for leaf in g.leaves(Role.PARAM) if g.tensors[leaf.tensor].ndim]
    # Layer by layer: the tied embedding is gathered by the first layer and by the head.
    embed = next(leaf.tensor for leaf in leaves if "embed" in leaf.path)
    assert len(gathers) == len(leaves) + 1 + len(rg.params)
    moved = g.role_bytes(Role.PARAM) + g.tensors[embed].nbytes + again
    assert comm_bytes(gathers, MESH)["all-gather@data"] == moved
    # XLA's buffer assignment: ZeRO-2 holds every parameter whole (its argument) and the
    # gathered copies; ZeRO-3 holds 1/8 of each and only the copies in use, so its
    # arguments and temporaries are below ZeRO-2's by at least the parameters' 7/8.
    z2, z3 = compiled(2).memory_analysis(), compiled(3).memory_analysis()
    share = g.role_bytes(Role.PARAM) * 7 / 8
    held = [m.argument_size_in_bytes + m.temp_size_in_bytes for m in (z2, z3)]
    assert held[0] - held[1] > 0.95 * share
    # Kept whole from forward to backward, the copies made that saving vanish (ZeRO-3
    # then held more than ZeRO-2: the gathered copies are temporaries, not arguments).
    assert z3.temp_size_in_bytes < z2.temp_size_in_bytes


def test_zero3_under_remat_gathers_again_what_the_recompute_reads():
    # Remat re-runs a layer's forward inside its backward: the recompute and the layer's
    # gradients read one second gather of its parameters (FSDP's), made after the layer's
    # gradient arrives, and the cost model charges it; with the forward's layer by layer,
    # about twice the parameters' bytes (the biases the backward does not read, less).
    spec, args, g, _ = gpt("float32")
    plan = dataclasses.replace(zero_plan(3, "float32"), remat=True)
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok, report.summary()
    gathered = report.xla_comm_bytes["all-gather@data"] / g.role_bytes(Role.PARAM)
    assert 1.9 < gathered < 2.2


def test_zero_moves_data_parallels_bytes_on_a_gpu_cluster():
    # Where reduce-scatter exists: gradients reduce-scattered, parameters gathered; the
    # two together take the time of data parallel's all-reduce (float32 gradients and
    # parameters: with 16-bit gradients the float32 gather moves twice their bytes).
    # ZeRO-3 gathers again for the backward, one gather per leaf: FSDP's 1.5x. A model
    # large enough for bandwidth, not latency, to set the time (abstract: nothing is
    # allocated; ZeRO-3 measured 1.60x here: its 19 backward gathers' latencies, one
    # forward gather per layer, which XLA can no longer combine into one, and one
    # reduce-scatter per backward layer (FSDP's, `_fsdp.py`) included).
    spec = get_model("gpt-1.3b", layers=2, hidden=2048, heads=16, seq=64, batch=16,
                     vocab=512, dtype="float32")  # fmt: skip
    g = capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(g)
    model = CostModel(g, Cluster.preset("a100", devices=8), groups)
    batch = {groups.batch_groups[0]: "data"}
    dp = model.evaluate(batch, MESH)
    grads = max(c.bytes for c in dp.collectives if c.kind == "all-reduce")
    again = sum(g.tensors[t].nbytes for t in regather_plan(g, groups).params)
    # layer by layer, the tied embedding is gathered by the first layer and by the head
    table = next(g.tensors[x.tensor].nbytes for x in g.leaves(Role.PARAM) if "embed" in x.path)
    again += table
    for stage in (1, 2, 3):
        z = model.evaluate(batch, MESH, zero_stage=stage)
        kinds = {(c.kind, c.axis): c.bytes for c in z.collectives}
        # ZeRO-3 reduce-scatters the tied table's two gradient parts apart, as the A100's
        # HLO does (tests/test_verify_gpu.py); data parallel all-reduces their sum once.
        scattered = grads + (table if stage == 3 else 0)
        assert kinds[("reduce-scatter", "data")] == pytest.approx(scattered, rel=0.01)
        gathered = g.role_bytes(Role.PARAM) + (again if stage == 3 else 0)
        assert kinds[("all-gather", "data")] == gathered
        assert kinds.get(("all-reduce", "data"), 0.0) < 0.01 * grads  # the loss, no gradient
        # an all-reduce is a reduce-scatter and an all-gather of the same bytes
        ratio = (scattered + gathered) / (2 * grads)
        assert z.comm_s == pytest.approx(ratio * dp.comm_s, rel=0.08 if stage == 3 else 0.06)
        assert z.memory_breakdown["opt_state"] == pytest.approx(
            dp.memory_breakdown["opt_state"] / 8, rel=0.01
        )


@pytest.mark.slow  # a Flax model compiled and run
def test_zero3_on_a_flax_model():
    # A third-party model (Flax modules, optax's Adam): the paths of its new parameters and
    # moments are matched to its inputs', and the pattern holds.
    args = flax_args(batch=64)
    g = capture(flax_step, *args)
    groups = build_groups(g)
    plan = plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=3)
    assert all("data" in str(s) for p, s in plan.out_specs.items() if "kernel" in p)
    report = verify(flax_step, plan, *args)
    assert report.collectives_match, report.summary()
    again = sum(g.tensors[t].nbytes for t in regather_plan(g, groups).params)
    assert again > 0.5 * g.role_bytes(Role.PARAM)  # the kernels, read by the backward
    gathered = g.role_bytes(Role.PARAM) + again
    assert report.xla_comm_bytes["all-gather@data"] == pytest.approx(gathered)
    # Memory: with its gradients reduced layer by layer the CPU step peaks in the backward,
    # where the CPU's price holds every residual the jaxpr keeps, more than XLA's CPU
    # keeps (1.33x its buffers here; it peaked at the end, within 15%, when one reduction
    # held every gradient): priced above XLA, not below.
    xla = report.xla_memory_bytes
    assert xla <= report.predicted_memory_bytes < 1.4 * xla
    assert report.numerics_ok, report.summary()


def test_zero_computes_only_the_kept_shard_of_what_it_pins():
    # The batch on "model", ZeRO over "data": a weight gradient is no partial sum over
    # data, and pinned to the ZeRO layout XLA computes only the device's data shard of
    # it (a [256, 64] piece of a [256, 256] gradient on data=4); the update runs on
    # shards. The cost model prices those shares (`_cost.zero_shares`): FLOPs per device
    # as XLA's cost analysis counts them, about 3/4 of the same layout without ZeRO.
    spec = get_model("mlp", batch=32)
    args = spec.abstract_args()
    g = capture(spec.step_fn, *args)
    groups = build_groups(g)
    mesh, batch = {"model": 2, "data": 4}, {groups.batch_groups[0]: "model"}
    plan = plan_from_assignment(g, groups, mesh, batch, zero_stage=2)
    text = compile_plan(spec.step_fn, plan, args, graph=g)[1].as_text()
    assert re.search(r"= f32\[256,64\]\{1,0\} dot\(", text)
    assert not re.search(r"= f32\[256,256\]\{1,0\} dot\(", text)
    report = verify(spec.step_fn, plan, *args)
    assert report.predicted_flops_as_xla == pytest.approx(report.xla_flops, rel=0.05)
    whole = verify(spec.step_fn, plan_from_assignment(g, groups, mesh, batch), *args)
    assert whole.predicted_flops_as_xla == pytest.approx(whole.xla_flops, rel=0.05)
    assert report.xla_flops < 0.8 * whole.xla_flops


def test_a_plan_whose_zero_stage_was_edited_is_refused_where_it_is_priced_or_run():
    # The cost model reads zero_stage, the runtime the shardings: an edited field would be
    # priced as ZeRO-2 (a gather, the moments sharded) and run as data parallel.
    spec, args, g, groups = gpt()
    edited = dataclasses.replace(zero_plan(0), zero_stage=2)
    cpu = Cluster.preset("cpu", devices=8)
    with pytest.raises(PlanError, match="zero_stage=2 but its shardings are those of zero_stag"):
        am.estimate(spec.step_fn, *args, plan=edited, cluster=cpu)
    with pytest.raises(PlanError, match="Make the plan again at stage 2"):
        compile_plan(spec.step_fn, edited, args, graph=g)
    # ZeRO-2's shardings are ZeRO-1's too: that edit changes nothing the runtime does.
    assert zero_mismatch(g, groups, zero_plan(2)) == ""
    assert zero_mismatch(g, groups, dataclasses.replace(zero_plan(2), zero_stage=1)) == ""
    assert "those of zero_stage=1 or 2" in zero_mismatch(
        g, groups, dataclasses.replace(zero_plan(2), zero_stage=3)
    )
    # A stage that does not exist gets a stage that does, not am.Recipe(..., zero=7).
    seven = zero_mismatch(g, groups, dataclasses.replace(zero_plan(2), zero_stage=7))
    assert "which is no ZeRO stage (0, 1, 2 or 3)" in seven and "back to 1." in seven
    assert "zero=7" not in seven
    # So is a mixed-precision plan whose zero_gather was edited: priced gathering float32
    # weights, it would run gathering their bf16 casts.
    params = zero_mismatch(g, groups, dataclasses.replace(zero_plan(2), zero_gather="params"))
    assert "zero_gather='params' but its shardings gather 'compute'" in params


def test_estimate_warns_of_zero_over_a_data_axis_the_batch_is_not_on():
    # XLA compiles other collectives for these plans than the cost model prices (what
    # ShardSpace.zero_options keeps out of the searches); estimate prices them, and says so.
    spec = get_model("mlp", batch=32)
    args = spec.abstract_args()
    g = capture(spec.step_fn, *args)
    groups = build_groups(g)
    mesh, cpu = {"model": 2, "data": 4}, Cluster.preset("cpu", devices=8)
    off = plan_from_assignment(g, groups, mesh, {groups.batch_groups[0]: "model"}, zero_stage=2)
    with pytest.warns(am.PriceWarning, match="does not put the batch on the data axis"):
        am.estimate(spec.step_fn, *args, plan=off, cluster=cpu)
    on = plan_from_assignment(g, groups, mesh, {groups.batch_groups[0]: "data"}, zero_stage=2)
    plain = plan_from_assignment(g, groups, mesh, {groups.batch_groups[0]: "model"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", am.PriceWarning)
        am.estimate(spec.step_fn, *args, plan=on, cluster=cpu)
        am.estimate(spec.step_fn, *args, plan=plain, cluster=cpu)


def test_zero2_of_a_mixed_precision_step_keeps_its_masters_on_shards_and_gathers_casts():
    # DeepSpeed's mixed precision: a weight read only through its bf16 cast keeps its
    # float32 master on the data shards, in and out of the step, like its Adam moments;
    # the step gathers the cast. A float32 step's ZeRO-2 plan is what it always was.
    spec, args, g, groups = gpt()
    plan = zero_plan(2)
    kernels = [p for p in plan.specs if p.startswith("[0]") and p.endswith("['kernel']")]
    assert plan.zero_gather == "compute" and kernels
    assert all("data" in plan.specs[k] for k in kernels)
    assert all("data" in s for p, s in plan.out_specs.items() if p.endswith("['kernel']"))
    plain = zero_plan(2, "float32")
    assert plain.zero_gather == "params"
    assert not any("data" in plain.specs[k] for k in kernels)
    # Read back as the old plans ran, the same plan is priced gathering float32 weights.
    cm = CostModel(g, Cluster.preset("a100", devices=8), groups)
    new, old = cm.estimate(plan), cm.estimate(dataclasses.replace(plan, zero_gather="params"))
    gathered = {c.kind: c.bytes for c in new.collectives}["all-gather"]
    assert gathered < 0.7 * {c.kind: c.bytes for c in old.collectives}["all-gather"]
    assert new.memory_breakdown["params"] < old.memory_breakdown["params"]
    # This step donates nothing: its new masters, held beside the old, are shards too
    # (gathering float32 weights it peaked at the update, holding them whole).
    masters = sum(g.tensors[t].nbytes for t in cm.tables.masters)
    held = old.memory_breakdown["outputs"] - new.memory_breakdown["outputs"]
    assert held >= masters * 7 / 8 and new.memory_bytes < old.memory_bytes
    # The CPU's compile gathers it as priced (16-bit collectives widened to float32 there).
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)


def test_a_tied_tables_two_casts_are_gathered_once_and_priced_once():
    # The tied embedding is read through two bf16 casts (the lookup's and the head's).
    # XLA merges the casts but not their all-gathers: the runtime has the head read the
    # lookup's gathered copy, so the compiled step gathers the table once, as priced.
    *_, g, groups = gpt()
    table = next(x.tensor for x in g.leaves(Role.PARAM) if "embed" in x.path)
    casts = narrow_params(g, zero_region(g, groups)[1])[table]
    assert len(casts) == 2 and repeated_casts(g, zero_region(g, groups)[1]) == {casts[1]: casts[0]}
    text = compiled(1).as_text()
    shape = ",".join(map(str, g.tensors[table].shape))
    gathers = re.findall(rf"= \w+\[{shape}\][^\n]* all-gather\(", text)
    assert len(gathers) == 1, gathers
    cm = CostModel(g, Cluster.preset("cpu", devices=8), groups)
    assert cm.tables.masters[table] == 1
    priced = {c.kind: c.bytes for c in cm.estimate(zero_plan(1)).collectives}["all-gather"]
    xla = comm_bytes(parse_collectives(text), MESH)["all-gather@data"]
    assert priced == pytest.approx(xla, rel=0.01)


@pytest.mark.slow  # run on 8 CPU devices and compared with the one-device step
def test_zero2_gathering_casts_computes_what_the_plain_step_does():
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128,
                     dtype="bfloat16")  # fmt: skip
    args = spec.concrete_args(0)
    plan = am.plan_recipe(
        spec.step_fn, *args, recipe=am.Recipe(dp=8, zero=2), cluster=Cluster.preset("cpu", 8)
    )
    assert plan.zero_gather == "compute"
    report = verify(spec.step_fn, plan, *args)
    assert report.numerics_ok is True, report.summary()
    assert report.collectives_match, report.summary()


def _odd_bias_step():
    """A bf16-compute step whose output bias (6 wide) no dim of 8 data shards divides."""
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adam(1e-3)

    def loss(p, x, y):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
        out = h @ p["w2"].astype(jnp.bfloat16) + p["b2"].astype(jnp.bfloat16)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {
        "w1": jax.random.normal(k1, (64, 128)) * 0.1,
        "w2": jax.random.normal(k2, (128, 6)) * 0.1,
        "b2": jnp.zeros((6,)),
    }
    x, y = jax.random.normal(k3, (32, 64)), jnp.ones((32, 6))
    return step, (p, opt.init(p), x, y)


def test_a_master_no_dim_of_which_the_data_axis_divides_is_priced_whole_and_not_gathered():
    # ZeRO-1/2 keeps a mixed-precision step's masters on shards, but a 6-wide bias has no
    # dim 8 divides: the runtime holds its master whole and gathers nothing of it. The
    # price says so (before: its master a shard, its cast gathered), estimate and ILP.
    import numpy as np

    from automap._search import MeshTerms, options_of
    from automap._solvers import evaluate_batch
    from automap._space import ShardSpace

    step, args = _odd_bias_step()
    g = capture(step, *args)
    groups = build_groups(g)
    plan = plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=2)
    assert plan.zero_gather == "compute"
    assert "data" in plan.specs["[0]['w1']"] and "data" not in plan.specs["[0]['b2']"]
    text = compile_plan(step, plan, args, graph=g)[1].as_text()
    assert not re.search(r"= \w+\[6\][^\n]* all-gather\(", text)
    cm = CostModel(g, Cluster.preset("cpu", devices=8), groups)
    cost = cm.estimate(plan)
    xla = comm_bytes(parse_collectives(text), MESH)["all-gather@data"]
    assert {c.kind: c.bytes for c in cost.collectives}["all-gather"] == pytest.approx(xla, 1e-6)
    size = {leaf.path: g.tensors[leaf.tensor].nbytes for leaf in g.leaves(Role.PARAM)}
    held = (size["[0]['w1']"] + size["[0]['w2']"]) / 8 + size["[0]['b2']"]
    assert cost.memory_breakdown["params"] == pytest.approx(held, rel=1e-9)
    # The shard ILP's factors give the same price (`_cost/_terms.py`, stated once).
    space = ShardSpace(g, groups, cm.cluster, cm)
    rng = np.random.default_rng(0)
    (m,) = [i for i, mesh in enumerate(space.meshes) if dict(mesh) == MESH]
    options = next(o for o in (options_of(space, m, rng) for _ in range(200))
                   if 2 in space.zero_options(space.meshes[m], o))  # fmt: skip
    terms = MeshTerms(space, m)
    problem = terms.problem(2)
    n_aux = problem.n_options[terms.n_units :]
    rows = np.array([[*options, *a] for a in np.ndindex(*n_aux)]).reshape(
        -1, len(problem.n_options)
    )
    time, peak, _ = evaluate_batch(problem, rows)
    priced = space.evaluate(m, options, zero_stage=2)
    assert time.min() == pytest.approx(priced.step_time_s, rel=1e-9)
    assert peak[np.argmin(time)] == pytest.approx(priced.memory_bytes, rel=1e-9)
