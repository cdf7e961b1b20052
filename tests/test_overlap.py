"""ZeRO-3's prefetch beside compute (`_cost/_overlap.py`): where the backend overlaps a
layer's gather with the previous layer's compute (`Lowering.overlaps_prefetch`), each such
pair costs max(gather, compute); every other collective stays on the critical path."""

import jax
import pytest

import automap as am
from automap._capture import capture
from automap._cost import AG, AxisCosts, CostModel, gather_beta
from automap._graph import Role
from automap._groups import build_groups
from automap._remat import layer_gathers
from automap._zoo import get_model


def _gpt():
    # float32: a gather moves the parameter's own bytes (a bf16 step gathers its casts)
    spec = get_model(
        "gpt2-xl", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128, dtype="float32"
    )
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


def _pairs(graph, groups, per_op, beta):
    """(gather seconds, previous layer's compute seconds) of each prefetched pair, from the
    layers (`_remat.layer_gathers`) and the plan's per-op compute: layer L >= 2 waits for
    layer L-1's input, so its gather may run while layer L-1 computes."""
    lg = layer_gathers(graph, groups)
    # the parameters each forward op reads, itself or through a value made from them alone
    root = {leaf.tensor: {leaf.tensor} for leaf in graph.leaves(Role.PARAM)}
    for i in sorted(lg.remake):
        made = set().union(*(root.get(t, set()) for t in graph.ops[i].inputs))
        root.update((t, made) for t in graph.ops[i].outputs)
    read = {
        (lg.layer(op.index), p)
        for op in graph.ops[: lg.regather.boundary + 1]
        if op.index not in lg.remake
        for t in op.inputs
        for p in root.get(t, ())
    }
    gathered: dict[int, float] = {}
    for layer, p in read:
        if lg.anchor[layer] is not None and graph.tensors[p].ndim:
            gathered[layer] = gathered.get(layer, 0.0) + graph.tensors[p].nbytes
    compute = {}
    for i, seconds, _ in per_op:
        if i <= lg.regather.boundary and i not in lg.remake:
            compute[lg.layer(i)] = compute.get(lg.layer(i), 0.0) + seconds
    return [(beta * nbytes, compute.get(layer - 1, 0.0)) for layer, nbytes in gathered.items()]


def test_each_prefetched_gather_costs_the_max_of_itself_and_the_layer_before():
    step, args = _gpt()
    graph = capture(step, *args)
    groups = build_groups(graph)
    a100 = am.Cluster.preset("a100", 8)
    overlapping = a100.with_lowering(overlaps_prefetch=True)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=8, zero=3), cluster=a100)
    charged = CostModel(graph, a100, groups).estimate(plan)
    cost = CostModel(graph, overlapping, groups).estimate(plan)
    beta = gather_beta(AxisCosts(a100, plan.mesh), 1)  # the data axis, the mesh's only
    pairs = _pairs(graph, groups, cost.per_op, beta)
    assert len(pairs) >= 3  # attention 1, MLP 1, the head: each behind the layer before
    hidden = sum(min(gather, compute) for gather, compute in pairs)
    assert hidden > 0
    assert charged.step_time_s - cost.step_time_s == pytest.approx(hidden, rel=1e-9)
    assert cost.compute_s == charged.compute_s  # the compute runs in full either way
    assert cost.comm_s == pytest.approx(charged.comm_s - hidden, rel=1e-9)
    assert cost.collectives == charged.collectives  # the collectives move all their bytes
    # the rate is the gather's over data: a ring's (n-1)/n of the bytes at the link's rate
    assert beta == pytest.approx(AxisCosts(a100, plan.mesh).beta[AG, :, 1].min())
    # both sides of the max occur: the MLP's gather (twice attention's bytes) outlasts
    # attention's compute before it; attention's hides behind the MLP's before it
    assert {gather < compute for gather, compute in pairs} == {True, False}


@pytest.mark.parametrize(
    "preset, recipe",
    [
        ("a100", am.Recipe(dp=8, zero=3)),  # XLA's GPU: the window left empty (test_schedule)
        ("tpu-v5p", am.Recipe(dp=8, zero=3)),  # XLA's TPU: every collective synchronous
        ("cpu", am.Recipe(dp=8, zero=3)),
        ("a100", am.Recipe(dp=8, zero=2)),  # no layer-by-layer gathers: nothing to prefetch
    ],
)
def test_where_nothing_overlaps_every_collective_is_on_the_critical_path(preset, recipe):
    step, args = _gpt()
    cluster = am.Cluster.preset(preset, 8)
    if recipe.zero < 3:
        cluster = cluster.with_lowering(overlaps_prefetch=True)
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=cluster)
    cost = am.estimate(step, *args, plan=plan, cluster=cluster)
    assert cost.comm_s == pytest.approx(sum(c.time_s for c in cost.collectives), rel=1e-12)
    assert cost.step_time_s == pytest.approx(cost.compute_s + cost.comm_s, rel=1e-12)


def test_a_cluster_file_can_ask_for_the_prefetch():
    assert "overlaps_prefetch" in am.Lowering.switches()
    assert not any(am.Lowering.preset(n).overlaps_prefetch for n in am.Lowering.presets())
