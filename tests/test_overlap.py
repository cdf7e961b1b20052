"""ZeRO-3's prefetch beside compute (`_cost/_overlap.py`): where the backend overlaps a
weight's gather with the forward's compute since the previous weight's reader
(`Lowering.overlaps_prefetch`), each such pair costs max(gather, compute); every other
collective stays on the critical path."""

import itertools

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
    """(gather seconds, compute seconds) of each prefetched pair, from the forward's reads
    (`_remat.layer_gathers`) and the plan's per-op compute: each weight (a matrix) after
    the first, in the order the forward first reads them, gathers while the forward runs
    from the previous weight's first reader up to its own (XLA's TPU chains)."""
    lg = layer_gathers(graph, groups)
    # the parameters each forward op reads, itself or through a value made from them alone
    root = {leaf.tensor: {leaf.tensor} for leaf in graph.leaves(Role.PARAM)}
    for i in sorted(lg.remake):
        made = set().union(*(root.get(t, set()) for t in graph.ops[i].inputs))
        root.update((t, made) for t in graph.ops[i].outputs)
    first: dict[int, int] = {}
    for op in graph.ops[: lg.regather.boundary + 1]:
        if op.index not in lg.remake:
            for p in set().union(*(root.get(t, set()) for t in op.inputs)):
                if graph.tensors[p].ndim >= 2:
                    first.setdefault(p, op.index)
    order = sorted(first, key=lambda p: (first[p], p))
    seconds = {i: s for i, s, _ in per_op if i <= lg.regather.boundary and i not in lg.remake}
    return [
        (
            beta * graph.tensors[p].nbytes,
            sum(s for i, s in seconds.items() if first[before] <= i < first[p]),
        )
        for before, p in itertools.pairwise(order)
    ]


def test_each_prefetched_gather_costs_the_max_of_itself_and_the_compute_before_its_weight():
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
    # every weight but the first: 2 layers' attention (4) and MLP (2) matrices, the head
    assert len(pairs) >= 12
    hidden = sum(min(gather, compute) for gather, compute in pairs)
    assert hidden > 0
    assert charged.step_time_s - cost.step_time_s == pytest.approx(hidden, rel=1e-9)
    assert cost.compute_s == charged.compute_s  # the compute runs in full either way
    assert cost.comm_s == pytest.approx(charged.comm_s - hidden, rel=1e-9)
    assert cost.collectives == charged.collectives  # the collectives move all their bytes
    # the rate is the gather's over data: a ring's (n-1)/n of the bytes at the link's rate
    assert beta == pytest.approx(AxisCosts(a100, plan.mesh).beta[AG, :, 1].min())
    # both sides of the max occur: a small matrix's gather hides behind the matmul
    # before it, a larger one's outlasts it
    assert {gather < compute for gather, compute in pairs} == {True, False}


@pytest.mark.parametrize(
    "preset, recipe",
    [
        ("a100", am.Recipe(dp=8, zero=3)),  # XLA's GPU: the window left empty (test_schedule)
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
    # XLA's TPU fills the window (under the runtime's flags, tests/test_schedule.py)
    on = {n for n in am.Lowering.presets() if am.Lowering.preset(n).overlaps_prefetch}
    assert on == {"tpu"}


def test_sequence_parallelism_keeps_the_prefetch_hidden():
    # A ZeRO-3 plan with the stream split (MaxText's v5p rows): sequence parallelism's
    # collectives are added to the plan's, and the forward gathers the TPU runs beside
    # compute stay off the path (they were charged again when its comm was re-summed).
    step, args = _gpt()
    v5p = am.Cluster.preset("tpu-v5p", 8)
    recipe = am.Recipe(dp=4, tp=2, zero=3, sequence_parallel=True)
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    cost = am.estimate(step, *args, plan=plan, cluster=v5p)
    serial = am.estimate(step, *args, plan=plan, cluster=v5p.with_lowering(overlaps_prefetch=False))
    assert cost.collectives == serial.collectives
    assert cost.comm_s < sum(c.time_s for c in cost.collectives)
    assert cost.step_time_s < serial.step_time_s
