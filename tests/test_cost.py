"""The cost model: collectives of the textbook plans, memory, feasibility, alpha-beta
formulas, the fast path against the plan path, and plans held against XLA."""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _cnn import CNN_ARGS, cnn, cnn_loss
from _ilp import ilp_price
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import AR, AxisCosts, CostModel, ring_allreduce_time, tree_allreduce_time
from automap._graph import Role
from automap._groups import build_groups, plan_from_assignment, regather_plan
from automap._remat import layer_gathers
from automap._search import MeshTerms, search_ilp
from automap._space import ShardSpace
from automap._verify import verify
from automap._zoo import get_model

A100 = Cluster.preset("a100", devices=16)


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@functools.cache
def mlp():
    def loss(params, x):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return (h @ params["w2"]).sum()

    params = {"w1": sds(64, 256), "b1": sds(256), "w2": sds(256, 32)}
    g = capture(jax.grad(loss), params, sds(32, 64), roles={0: "param", 1: "batch"})
    return g, build_groups(g)


@functools.cache
def gpt(donate: bool = False):
    """A small GPT; `donate`: its step jitted with donate_argnums, as a training loop's."""
    spec = get_model("gpt2-xl", layers=2, hidden=64, heads=4, vocab=128, seq=16, batch=8)
    args = spec.abstract_args()
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1)) if donate else spec.step_fn
    g = capture(step, *args)
    return spec, args, g, build_groups(g)


def param_group(g, groups, suffix, dim):
    (t,) = [x.tensor for x in g.leaves(Role.PARAM) if x.path.endswith(suffix)]
    return groups.of(t, dim)


def megatron(g, groups, layers=2):
    out = {}
    for i in range(layers):
        out[param_group(g, groups, f"layer_{i}']['attention']['query']['kernel']", 1)] = "model"
        out[param_group(g, groups, f"layer_{i}']['mlp']['wi']['kernel']", 1)] = "model"
    return out


def by_key(cost):
    return {(c.kind, c.axis): c for c in cost.collectives}


def test_data_parallel_all_reduces_the_gradients_once():
    g, groups = mlp()
    cost = CostModel(g, A100, groups).evaluate({groups.batch_groups[0]: "data"}, {"data": 8})
    (ar,) = cost.collectives
    assert (ar.kind, ar.axis, ar.count) == ("all-reduce", "data", 1)  # one tuple all-reduce
    assert ar.bytes == g.role_bytes(Role.PARAM)  # gradient bytes
    n, link = 8, A100.axis_links({"data": 8})["data"]
    expected = ring_allreduce_time(ar.bytes, n, link.bandwidth * A100.comm_efficiency, link.latency)
    assert ar.time_s == pytest.approx(
        min(
            expected,
            tree_allreduce_time(ar.bytes, n, link.bandwidth * A100.comm_efficiency, link.latency),
        )
    )
    assert cost.comm_s == pytest.approx(ar.time_s)


def test_megatron_all_reduces_activations_twice_per_layer_forward():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    cost = model.evaluate(megatron(g, groups), {"model": 4}, detail=True)
    (ar,) = cost.collectives
    assert (ar.kind, ar.axis) == ("all-reduce", "model")
    forward = model.tables.op_coef.size and max(i for i in range(len(g.ops)) if i <= _boundary(g))
    fwd_ops = [i for i, _, comm in cost.per_op if comm > 0 and i <= forward]
    assert len(fwd_ops) == 2 * 2  # attention out and MLP out, in each of 2 layers
    activation = 8 * 16 * 64 * 2  # one bf16 [batch, seq, hidden] per all-reduce
    assert ar.bytes == ar.count * activation
    # No gradient all-reduce: every device holds its own shard of the weights.
    assert not any(c.axis == "data" for c in cost.collectives)


def _boundary(g):
    from automap._capture import find_residuals

    return find_residuals(g).boundary


def test_memory_decreases_with_sharding_and_zero():
    # A step that donates its state: one that does not peaks at its update, its new state
    # beside the old, where data parallel also holds its reduced gradients and the
    # replicated plan none (XLA's buffer assignment on A100s has the two within 1%).
    _, _, g, groups = gpt(donate=True)
    model = CostModel(g, A100, groups)
    dp = {groups.batch_groups[0]: "data"}
    none = model.evaluate({}, {"data": 8})
    data = model.evaluate(dp, {"data": 8})
    hybrid = model.evaluate({**dp, **megatron(g, groups)}, {"data": 2, "model": 4})
    assert none.memory_bytes > data.memory_bytes
    assert hybrid.memory_breakdown["params"] < data.memory_breakdown["params"]
    zero = [model.evaluate(dp, {"data": 8}, zero_stage=z) for z in range(4)]
    mem = [z.memory_bytes for z in zero]
    # ZeRO-1 and 2 compile to the same program (the local gradients are whole until their
    # reduce-scatter in both); ZeRO-3 also stores the parameters sharded.
    assert mem[0] > mem[1] == mem[2] > mem[3]
    assert zero[1].memory_breakdown["opt_state"] == pytest.approx(
        zero[0].memory_breakdown["opt_state"] / 8, rel=0.01
    )
    # ZeRO as the plan pins it (it used to gather the moments for a whole update): the
    # gradients' all-reduce becomes a reduce-scatter of the same bytes, and the
    # parameters are gathered once after the sharded update, or (ZeRO-3) for use in the
    # forward and again for the backward's reads (`tests/test_zero.py`): the bf16 casts
    # those read, half the float32 parameters' bytes (`tests/test_verify_gpu.py`).
    params = zero[0].memory_breakdown["params"]
    regathered = regather_plan(g, groups).params
    again = sum(g.tensors[t].nbytes for t in regathered)
    casts = sum(model.tables.gathered.values()) + sum(model.tables.gathered[t] for t in regathered)
    assert casts == pytest.approx((params + again) / 2, rel=0.05)
    # gathered layer by layer: a parameter read by two layers (the tied embedding) twice
    casts += sum(model.tables.gathered[p] * (n - 1) for p, n in layers_reading(g, groups).items())
    # ZeRO-1/2 of this bf16 step keeps the float32 masters on shards and gathers their
    # casts (one copy per dtype: the tied table's two bf16 casts share one gather), the
    # rest (LayerNorm's, read in float32) whole.
    masters = model.tables.masters
    rest = sum(g.tensors[x.tensor].nbytes for x in g.leaves(Role.PARAM) if x.tensor not in masters)
    cast = sum(model.tables.gathered[t] * n for t, n in masters.items())
    assert cast + rest < 0.6 * params
    grads = by_key(zero[0])[("all-reduce", "data")].bytes
    for stage in (1, 2, 3):
        k = by_key(zero[stage])
        assert k[("reduce-scatter", "data")].bytes == pytest.approx(grads, rel=0.01)
        gathered = casts if stage == 3 else cast + rest
        assert k[("all-gather", "data")].bytes == pytest.approx(gathered)
    # Data parallel peaks at the gradients' reduction (the activations are gone by then);
    # unsplit, nothing is reduced and the peak is the activations'.
    assert data.memory_breakdown["activations"] == 0.0 < none.memory_breakdown["activations"]
    acts = model.evaluate({}, {"data": 8}, microbatches=4).memory_breakdown["activations"]
    assert acts == pytest.approx(none.memory_breakdown["activations"] / 4)
    remat = model.evaluate({}, {"data": 8}, remat=True)
    assert remat.memory_breakdown["activations"] < none.memory_breakdown["activations"]
    assert remat.compute_s > none.compute_s


def test_a_reduction_without_reduce_scatter_writes_a_whole_copy():
    # A scheduled step ends with the gradients and what their reduction writes: ZeRO's
    # reduce-scatter the device's shards; a backend without one (XLA's CPU all-reduces and
    # slices) a whole copy, as data parallel's all-reduce does. (A step that donates its
    # state: one that does not peaks at its update, its new state beside the old.)
    _, _, g, groups = gpt(donate=True)
    dp = {groups.batch_groups[0]: "data"}
    no_scatter = A100.with_lowering(reduce_scatter=False)
    cost = CostModel(g, no_scatter, groups).evaluate(dp, {"data": 8}, zero_stage=2)
    reduced = by_key(cost)[("all-reduce", "data")].bytes
    assert cost.memory_breakdown["activations"] == 0.0  # the reduction is the peak
    assert cost.memory_breakdown["grads"] == pytest.approx(2 * reduced, rel=1e-4)  # + a scalar
    shards = CostModel(g, A100, groups).evaluate(dp, {"data": 8}, zero_stage=2)
    assert shards.memory_bytes < cost.memory_bytes


def test_over_the_memory_limit_is_infeasible_with_a_reason():
    _, _, g, groups = gpt()
    tiny = dataclasses.replace(Cluster.preset("cpu", devices=8), hbm_bytes=1e6)
    cost = CostModel(g, tiny, groups).evaluate({}, {"data": 8})
    assert not cost.feasible
    assert "GB per device" in cost.reason and "activations" in cost.reason
    assert cost.memory_limit_bytes == tiny.memory_limit
    assert CostModel(g, A100, groups).evaluate({}, {"data": 8}).feasible


def test_compute_divides_by_the_sharding_and_mfu_is_sane():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    one = model.evaluate({}, {"data": 8}, detail=True)
    dp = model.evaluate({groups.batch_groups[0]: "data"}, {"data": 8}, detail=True)
    dots = [op.index for op in g.ops if op.primitive == "dot_general"]
    # Every matmul of a training step touches the batch (forward, and the weight gradients
    # contract over it); the optimizer's elementwise update does not, and stays whole.
    assert sum(dp.per_op[i][1] for i in dots) == pytest.approx(
        sum(one.per_op[i][1] for i in dots) / 8
    )
    assert one.compute_s / 8 < dp.compute_s < one.compute_s
    assert 0 < dp.mfu <= 1 and dp.step_time_s == pytest.approx(dp.compute_s + dp.comm_s)


def test_estimate_matches_evaluate_and_reads_specs_without_decisions():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    assignment = {groups.batch_groups[0]: "data", **megatron(g, groups)}
    mesh = {"data": 2, "model": 4}
    plan = plan_from_assignment(g, groups, mesh, assignment, zero_stage=1)
    fast = model.evaluate(assignment, mesh, zero_stage=1)
    est = model.estimate(plan)
    assert est.step_time_s == pytest.approx(fast.step_time_s)
    assert est.memory_bytes == pytest.approx(fast.memory_bytes)
    assert len(est.per_op) == len(g.ops)
    assert sum(c for _, c, _ in est.per_op) == pytest.approx(est.compute_s)
    derived = model.estimate(dataclasses.replace(plan, decisions={}))
    assert derived.step_time_s == pytest.approx(est.step_time_s)
    assert by_key(derived) == by_key(est)


def test_codes_array_is_the_dict_assignment():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    assignment = {groups.batch_groups[0]: "data", **megatron(g, groups)}
    mesh = {"data": 2, "model": 4}
    codes = np.zeros(len(groups.groups), dtype=np.int64)
    for gid, axis in assignment.items():
        codes[gid] = list(mesh).index(axis) + 1
    assert model.evaluate(codes, mesh) == model.evaluate(assignment, mesh)
    # A split the group cannot take (4 heads on 8 devices) is ignored.
    heads = param_group(g, groups, "layer_0']['attention']['query']['kernel']", 1)
    assert model.evaluate({heads: "model"}, {"model": 8}) == model.evaluate({}, {"model": 8})


def test_alpha_beta_per_axis():
    mesh = {"data": 2, "model": 8}
    ac = AxisCosts(A100, mesh)
    links = A100.axis_links(mesh)
    assert links["model"].kind == "intra" and links["data"].kind == "inter"
    model, data = 2, 1  # axis masks: bit i-1 for axis i in mesh order
    big = ac.time1(AR, model, 1e9)
    bw = links["model"].bandwidth * A100.comm_efficiency
    assert big == pytest.approx(ring_allreduce_time(1e9, 8, bw, links["model"].latency))
    small = ac.time1(AR, model, 8.0)
    assert small == pytest.approx(tree_allreduce_time(8.0, 8, bw, links["model"].latency))
    assert ac.time1(AR, data, 1e9) > ac.time1(AR, model, 1e9) / 4  # the network is slower
    assert ac.names[data | model] == "data+model"
    assert ac.time1(AR, 0, 1e9) == 0.0


@pytest.mark.slow  # GPT plans compiled
@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_gpt_plan_matches_xla_collectives(zero_stage):
    spec, args, g, groups = gpt()
    assignment = {groups.batch_groups[0]: "data", **megatron(g, groups)}
    mesh = {"data": 2, "model": 4}
    plan = plan_from_assignment(g, groups, mesh, assignment, zero_stage=zero_stage)
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match, report.summary()
    total = sum(report.xla_comm_bytes.values())
    assert math.isclose(sum(report.predicted_comm_bytes.values()), total, rel_tol=0.05)


def test_one_group_delta_equals_a_full_evaluation():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    mesh = {"data": 2, "model": 4}
    base_assignment = {groups.batch_groups[0]: "data"}
    base = model.state(base_assignment, mesh)
    current = dict(base_assignment)
    for gid, axis in megatron(g, groups).items():
        cost, base = model.evaluate_delta(base, {gid: axis}, zero_stage=1)
        current[gid] = axis
        same(cost, model.evaluate(current, mesh, zero_stage=1))
    back, _ = model.evaluate_delta(base, {gid: None})
    del current[gid]
    same(back, model.evaluate(current, mesh))


def same(a, b):
    assert a.step_time_s == pytest.approx(b.step_time_s)
    assert a.memory_bytes == pytest.approx(b.memory_bytes)
    assert by_key(a).keys() == by_key(b).keys()
    for k, c in by_key(a).items():
        assert (c.bytes, c.count) == (pytest.approx(by_key(b)[k].bytes), by_key(b)[k].count)


def test_per_op_breakdown_adds_up():
    _, _, g, groups = gpt()
    model = CostModel(g, A100, groups)
    assignment = {groups.batch_groups[0]: "data", **megatron(g, groups)}
    cost = model.evaluate(assignment, {"data": 2, "model": 4}, detail=True)
    assert sum(c for _, c, _ in cost.per_op) == pytest.approx(cost.compute_s)
    assert sum(m for _, _, m in cost.per_op) == pytest.approx(cost.comm_s)


def test_fast_evaluation_equals_the_detailed_estimate():
    # The searchers optimize evaluate(); plans are priced by estimate(): they must agree,
    # or an exact optimum of one is not the optimum of the other.
    import automap as am
    from automap._search import Problem, priced_experts
    from automap._zoo import get_model

    spec = get_model("bert-base", layers=2, hidden=128, heads=8, seq=32, batch=8)
    problem = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 16), None)
    # One-stage plans: a pipeline's cost is its schedule's, not evaluate()'s.
    for name, plan in priced_experts(problem, pipelines=False).items():
        assignment = dict(plan.assignment)
        fast = problem.cost_model.evaluate(assignment, plan.mesh, zero_stage=plan.zero_stage)
        assert fast.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12), name
        assert fast.memory_bytes == pytest.approx(plan.predicted.memory_bytes, rel=1e-12), name


def test_a_seam_moves_the_batch_only_where_its_sides_differ():
    graph, groups = cnn()
    _, whole = cnn(seams=False)
    images, labels = (leaf.tensor for leaf in graph.leaves(Role.BATCH))
    conv, dense = groups.of(images, 0), groups.of(labels, 0)
    mesh, cpu = {"data": 8}, Cluster.preset("cpu", devices=8)
    model = CostModel(graph, cpu, groups)
    # Both sides on one axis: exactly the cost of the uncut batch (no spurious gather).
    both = model.evaluate({conv: "data", dense: "data"}, mesh)
    uncut = CostModel(graph, cpu, whole).evaluate({whole.batch_groups[0]: "data"}, mesh)
    assert both.step_time_s == pytest.approx(uncut.step_time_s, rel=1e-12)
    assert both.collectives == uncut.collectives
    # Convolutions split, dense layers whole: the flatten gathers its [16, 8, 8, 8] input.
    # Dense split, convolutions whole: the backward unflatten gathers its [16, 512] input.
    for assignment, gathered in (({conv: "data"}, 16 * 512 * 4), ({dense: "data"}, 16 * 512 * 4)):
        cost = model.evaluate(assignment, mesh)
        (gather,) = [c for c in cost.collectives if c.kind == "all-gather"]
        assert (gather.bytes, gather.count) == (gathered, 1)
        plan = plan_from_assignment(graph, groups, mesh, assignment)
        report = verify(jax.grad(cnn_loss), plan, *CNN_ARGS)
        assert report.collectives_match, report.summary()


# A weight gradient contracts the batch and the sequence: split on two mesh axes, the sum
# is partial over both. At top level and inside a scan over stacked layers.
TB, TS, TD, TL = 8, 16, 32, 3


def _top(w, x):
    return jnp.tanh(x @ w).sum()


def _scanned(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h.sum()


@functools.cache
def two_axis(scan: bool):
    step = jax.grad(_scanned if scan else _top)
    args = (sds(TL, TD, TD) if scan else sds(TD, TD), sds(TB, TS, TD))
    g = capture(step, *args, roles={0: "param", 1: "batch"})
    groups = build_groups(g)
    (x,) = (leaf.tensor for leaf in g.leaves(Role.BATCH))
    assignment = {groups.of(x, 0): "data", groups.of(x, 1): "model"}
    return step, args, g, groups, assignment


@pytest.mark.parametrize("scan", [False, True])
def test_a_sum_over_two_axes_is_two_all_reduces_on_the_cpu_one_on_gpus(scan):
    step, args, g, groups, assignment = two_axis(scan)
    mesh = {"data": 2, "model": 4}
    plan = plan_from_assignment(g, groups, mesh, assignment)
    grad_bytes = g.role_bytes(Role.PARAM)  # the whole weight gradient, once per layer
    # XLA's SPMD partitioner reduces one axis at a time; its CPU backend keeps the chain.
    report = verify(step, plan, *args)
    assert report.collectives_match, report.summary()
    chain = {"all-reduce@data": grad_bytes, "all-reduce@model": grad_bytes}
    assert report.xla_comm_bytes == chain
    assert report.predicted_comm_bytes == chain
    # GPUs fold an all-reduce feeding another into one over both axes (AllReduceFolder).
    gpu = CostModel(g, Cluster.preset("a100", devices=8), groups).estimate(plan)
    (joint,) = gpu.collectives
    assert (joint.kind, joint.axis, joint.bytes) == ("all-reduce", "data+model", grad_bytes)


def _points(space, mesh):
    """Every valid option tuple of the space on `mesh` (a tiny space: a few units)."""

    def extend(taken):
        if len(taken) == len(space.units):
            yield tuple(taken)
            return
        for k in np.flatnonzero(space.allowed(mesh, len(taken), taken)):
            yield from extend([*taken, int(k)])

    return list(extend([]))


def test_the_ilp_prices_the_cpus_chain_as_the_cost_model_does():
    _, _, g, groups, _ = two_axis(True)
    cpu = Cluster.preset("cpu", devices=8)
    space = ShardSpace(g, groups, cpu, CostModel(g, cpu, groups))
    chained = 0
    for mesh_index, mesh in enumerate(space.meshes):
        terms = MeshTerms(space, mesh_index)
        for zero in space.zero_options(mesh):
            problem = terms.problem(zero)
            for options in _points(space, mesh):
                cost = space.evaluate(mesh_index, options, zero_stage=zero)
                chained += {c.axis for c in cost.collectives} >= {"data", "model"}
                time, memory, _ = ilp_price(problem, terms.n_units, options)
                assert time == pytest.approx(cost.step_time_s, rel=1e-9)
                assert memory == pytest.approx(cost.memory_bytes, rel=1e-9)
    assert chained  # the points with a sum over both axes were among them
    point, stats = search_ilp(space)
    assert stats["optimal"] and stats["objective_error"] <= 1e-6
    best = space.evaluate(point[0], point[1], zero_stage=point[2]).step_time_s
    assert best == pytest.approx(
        min(
            space.evaluate(m, o, zero_stage=z).step_time_s
            for m, mesh in enumerate(space.meshes)
            for z in space.zero_options(mesh)
            for o in _points(space, mesh)
        ),
        rel=1e-9,
    )


def layers_reading(g, groups) -> dict[int, int]:
    """Per parameter, how many forward layers (`_remat.layer_gathers`) read it, directly or
    through values made from it alone (its cast)."""
    lg = layer_gathers(g, groups)
    root = {x.tensor: {x.tensor} for x in g.leaves(Role.PARAM)}
    for i in sorted(lg.remake):
        made = set().union(*(root.get(t, set()) for t in g.ops[i].inputs))
        root.update((t, made) for t in g.ops[i].outputs)
    pairs = {
        (lg.layer(op.index), p)
        for op in g.ops[: lg.regather.boundary + 1]
        if op.index not in lg.remake
        for t in op.inputs
        for p in root.get(t, ())
    }
    return dict(collections.Counter(p for _, p in pairs))
