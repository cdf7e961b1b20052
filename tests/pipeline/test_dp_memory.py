"""The stage DP's memory: what it knows without pricing (the stored state's floor, by
which it skips shapes and intra-stage plans and orders the rest), and its partitions held
to the whole pipeline model under recomputation (issue 26: on the largest published rows
the DP found no pipeline)."""

import dataclasses

import pytest

import automap as am
from automap._axes import DATA, MODEL
from automap._cost import CostModel, estimate_pipeline, leaf_bytes, op_costs
from automap._pipeline import (
    cut_candidates,
    partition,
    pipeline_plan,
    pipeline_schedule,
    uniform_cuts,
)
from automap._remat import aligned_cuts, layer_spans
from automap._search import (
    MEMORY_SAVERS,
    Problem,
    fitting_savers,
    priced_cuts,
    search_dp,
    search_shapes,
)
from automap._space import (
    Point,
    StateBytes,
    axis_assignment,
    batch_groups,
    block_groups,
    state_bytes,
)
from automap._zoo import get_model

A100 = am.Cluster.preset("a100", 8)
ONE = pipeline_schedule("1f1b")


@pytest.fixture(scope="module")
def wide():
    """Four wide layers in mixed precision (float32 parameters, bf16 compute): each
    weight has a 16-bit cast the backward reads."""
    spec = get_model("gpt2-xl", layers=4, hidden=2048, heads=16, batch=8, seq=1024)
    return Problem.build(spec.step_fn, spec.abstract_args(), A100)


def _assignment(pb, mesh):
    groups = pb.groups
    return {
        **axis_assignment(batch_groups(groups), DATA, mesh.get(DATA, 1)),
        **axis_assignment(block_groups(groups), MODEL, mesh.get(MODEL, 1)),
    }


@pytest.mark.parametrize(
    ("S", "mesh", "zero", "remat"),
    [
        (2, {MODEL: 4}, 0, False),
        (2, {DATA: 2, MODEL: 2}, 1, False),
        (4, {DATA: 2}, 1, True),
        (2, {DATA: 4}, 3, True),
        (4, {MODEL: 2}, 0, True),
    ],
)
def test_the_state_floor_is_below_what_each_pipeline_is_priced(wide, S, mesh, zero, remat):
    # The floor skips a shape without pricing it: it must never exceed what the whole
    # model prices a plan of that shape at, by the step's state or by one plan's layout.
    pb = wide
    state = state_bytes(pb.graph, pb.groups)
    assert state is not None and state.params > 0 and state.opt_state > state.params
    assignment = _assignment(pb, mesh)
    plan = pipeline_plan(
        pb.graph, pb.groups, uniform_cuts(pb.graph, pb.groups, S), mesh, assignment, 4,
        "1f1b", zero_stage=zero,
    )  # fmt: skip
    plan = dataclasses.replace(plan, remat=remat)
    priced = estimate_pipeline(pb.cost_model, plan).cost.memory_bytes
    data, model = mesh.get(DATA, 1), mesh.get(MODEL, 1)
    assert state.floor(S, model, data, zero) <= priced
    laid = StateBytes(*leaf_bytes(pb.cost_model, assignment, mesh))
    assert laid.floor(S, 1, data, zero) <= priced


def test_the_dp_searches_the_shapes_whose_state_fits_plainly_first(wide):
    # Under 1.6 GB a device, the stored state alone fits without ZeRO only where it is
    # split four ways or more: those shapes come first, fewest stages first; then those
    # that need ZeRO. A shape where no saver may fit is never searched.
    pb = wide
    device = dataclasses.replace(A100, hbm_bytes=1.6e9)
    model = CostModel(pb.graph, device, pb.groups)
    state = state_bytes(pb.graph, pb.groups)
    stats: dict = {}
    order = search_shapes(model, len(cut_candidates(pb.graph, pb.groups)), state, stats)
    limit = device.memory_limit
    needs = [MEMORY_SAVERS.index(fitting_savers(state, S, mesh, limit)[0]) for S, _, mesh in order]
    assert needs == sorted(needs) and needs[0] == 0 and needs[-1] > 0
    plain = [
        S * mesh.get(MODEL, 1) for (S, _, mesh), need in zip(order, needs, strict=True) if need == 0
    ]
    assert min(plain) >= 4
    assert [S for (S, _, _), need in zip(order, needs, strict=True) if need == 0] == sorted(
        S for (S, _, _), need in zip(order, needs, strict=True) if need == 0
    )
    for S, _, mesh in order:
        assert fitting_savers(state, S, mesh, limit)


@pytest.mark.parametrize("scale", [0.97, 1.02, 1.25, 2.0])
def test_under_recomputation_the_dp_finds_a_pipeline_where_the_whole_model_fits_one(wide, scale):
    """Two stages of tp 4, full recomputation, 8 microbatches: under device limits from
    just below the leanest partition's memory (by the whole model) to well above it, the
    DP returns a pipeline exactly where one fits, and it fits. Its tables leave out each
    stage's temporaries (0.4 to 0.7 GB here): at 1.02 times its partition was over the
    limit and nothing was returned, until it cut again under a limit less what they left
    out."""
    pb = wide
    graph, groups = pb.graph, pb.groups
    mesh = {MODEL: 4}
    assignment = _assignment(pb, mesh)
    whole = aligned_cuts(cut_candidates(graph, groups), layer_spans(graph, groups))
    bounds = list(zip((0, *whole), (*whole, len(graph.ops)), strict=True))
    fine = partition(graph, groups, bounds, 1)
    memory = {}
    for c in whole:
        plan = pipeline_plan(graph, groups, (c,), mesh, assignment, 8, "1f1b")
        plan = dataclasses.replace(plan, remat=True)
        memory[c] = estimate_pipeline(pb.cost_model, plan).cost.memory_bytes
    least = min(memory.values())
    device = dataclasses.replace(A100, hbm_bytes=least * scale / (1.0 - A100.memory_reserve))
    model = CostModel(graph, device, groups)
    oc = op_costs(model, assignment, mesh, remat=True)
    found = priced_cuts(model, fine, whole, oc, Point(2, mesh, 8, "test"), assignment, ONE)
    assert (found is None) == (scale < 1)
    if found is not None:
        assert found.predicted.feasible and found.predicted.memory_bytes <= device.memory_limit
        assert memory[found.decisions["cuts"][0]] <= device.memory_limit


def test_where_no_state_fits_the_dp_prices_nothing_and_says_so(wide):
    # Under 0.5 GB a device no shape's stored state fits under any saver (every floor is
    # above it): the search prices no point, and its stats say it is complete, a proof
    # that no pipeline of its space fits, with the shapes it skipped counted.
    device = dataclasses.replace(wide.cluster, hbm_bytes=0.5e9 / (1.0 - A100.memory_reserve))
    model = CostModel(wide.graph, device, wide.groups)
    pb = dataclasses.replace(wide, cluster=device, cost_model=model)
    plan, stats = search_dp(pb, budget_s=60)
    assert plan is None and stats["complete"] and stats["points"] == 0
    assert stats["state_overflows"] > 0
