"""The partition of a training step into stages and phases, and the cut helpers."""

import collections

import pytest

from automap import PlanError
from automap._capture import capture
from automap._graph import Role
from automap._groups import build_groups
from automap._pipeline import (
    Phase,
    crossing_bytes,
    cut_candidates,
    forward_ops,
    partition,
    pipeline_plan,
    uniform_cuts,
)

from ._models import batchnorm_step_and_args, zoo


def _bounds(graph, cuts):
    starts = [0, *cuts]
    return list(zip(starts, [*cuts, len(graph.ops)], strict=True))


@pytest.fixture(scope="module")
def gpt_two_stages():
    _, graph, groups = zoo("gpt2-xl")
    cuts = uniform_cuts(graph, groups, 2)
    return graph, groups, cuts, partition(graph, groups, _bounds(graph, cuts), microbatches=2)


def test_forward_ops_of_a_stage_lie_in_its_range(gpt_two_stages):
    graph, _, cuts, part = gpt_two_stages
    for s, (start, stop) in enumerate(_bounds(graph, cuts)):
        fwd = part.ops(s, Phase.FWD)
        assert fwd and all(start <= i < stop for i in fwd)
    assert (
        max(part.ops(1, Phase.FWD)) == part.forward_end
        or part.op_phase[part.forward_end] is Phase.POST
    )  # the loss division runs once, after the microbatches


def test_backward_data_flows_only_to_lower_stages(gpt_two_stages):
    graph, _, _, part = gpt_two_stages
    assert part.ops(0, Phase.BWD) and part.ops(1, Phase.BWD)
    for op in graph.ops:
        if part.op_phase[op.index] is not Phase.BWD:
            continue
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p is not None and part.op_phase[p] is Phase.BWD:
                assert part.op_stage[p] >= part.op_stage[op.index]


def test_every_parameter_gradient_is_accumulated(gpt_two_stages):
    graph, _, _, part = gpt_two_stages
    # One accumulated tensor of each parameter's shape at least (a tied embedding has two
    # gradient pieces, added once after the microbatches).
    params = collections.Counter(
        graph.tensors[leaf.tensor].shape for leaf in graph.leaves(Role.PARAM)
    )
    summed = collections.Counter(graph.tensors[t].shape for t in part.accumulated)
    assert all(summed[shape] >= n for shape, n in params.items())
    # ...and each is made per microbatch, on the stage that owns that parameter's update.
    for t in part.accumulated:
        assert part.op_phase[graph.tensors[t].producer] in (Phase.FWD, Phase.BWD)
    assert all(t not in part.batched for t in part.accumulated)


def test_batch_norm_refuses_microbatches_but_runs_whole():
    step, args = batchnorm_step_and_args()
    graph = capture(step, *args)
    groups = build_groups(graph)
    fwd = forward_ops(graph, groups)
    bounds = [(0, fwd[len(fwd) // 2]), (fwd[len(fwd) // 2], len(graph.ops))]
    with pytest.raises(PlanError, match="batch normalization"):
        partition(graph, groups, bounds, microbatches=2)
    part = partition(graph, groups, bounds, microbatches=1)
    assert part.n_stages == 2


def test_bad_stage_ranges_refused(gpt_two_stages):
    graph, groups, cuts, _ = gpt_two_stages
    with pytest.raises(PlanError, match=f"should start at op {cuts[0]}"):
        partition(graph, groups, [(0, cuts[0]), (cuts[0] + 1, len(graph.ops))])
    with pytest.raises(PlanError, match="before the forward pass does"):
        partition(graph, groups, [(0, cuts[0]), (cuts[0], cuts[0] + 1)])


def test_cut_candidates_are_layer_boundaries():
    _, graph, groups = zoo("gpt2-xl")
    fwd, cross = crossing_bytes(graph, groups)
    cands = cut_candidates(graph, groups)
    assert set(cands) <= set(fwd) and list(cands) == sorted(cands)
    pos = {i: k for k, i in enumerate(fwd)}
    residual = 8 * 16 * 32 * 4  # [batch, seq, hidden] float32: the stream between layers
    between_layers = [c for c in cands if cross[pos[c]] == residual]
    assert len(between_layers) >= 2 * 2  # two residual adds per layer
    assert max(cross) > 2 * residual  # the others are not candidates: they cost more
    assert all(cross[pos[c]] <= 1.25 * residual for c in cands)


def test_uniform_cuts_and_the_plan_they_make():
    _, graph, groups = zoo("gpt2-xl")
    cuts = uniform_cuts(graph, groups, 4)
    assert len(cuts) == 3 and set(cuts) <= set(cut_candidates(graph, groups))
    plan = pipeline_plan(graph, groups, cuts, {"data": 2}, {groups.batch_groups[0]: "data"}, 4)
    assert plan.mesh == {"pipe": 4, "data": 2} and plan.devices == 8
    assert [s.devices for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.op_start for s in plan.stages] == [0, *cuts]
    assert plan.stages[-1].op_stop == len(graph.ops)
    assert plan.decisions["cuts"] == list(cuts)
    with pytest.raises(PlanError, match="Use fewer stages"):
        uniform_cuts(graph, groups, 100)
