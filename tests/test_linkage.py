"""Linkage groups: chains through layers, heads apart from hidden, the batch, layer classes,
layouts and the plans made from an assignment."""

import functools

import jax
import jax.numpy as jnp
import pytest

from _cnn import cnn
from automap._capture import capture
from automap._graph import Role
from automap._groups import build_groups, expand_classes, layouts, plan_from_assignment, zero_spec
from automap._zoo import get_model


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@functools.cache
def gpt():
    spec = get_model("gpt2-xl", layers=2, hidden=64, heads=4, vocab=128, seq=16, batch=8)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return graph, build_groups(graph)


def leaf(graph, suffix):
    roles = (Role.PARAM, Role.BATCH)
    (found,) = [x for x in graph.inputs if x.path.endswith(suffix) and x.role in roles]
    return found.tensor


def mlp_graph():
    def loss(params, x):
        h = jnp.tanh(x @ params["w1"])
        return (h @ params["w2"]).sum()

    params = {"w1": sds(16, 32), "w2": sds(32, 8)}
    return capture(jax.grad(loss), params, sds(4, 16), roles={0: "param", 1: "batch"})


def test_mlp_hidden_dims_chain_across_layers():
    g = mlp_graph()
    groups = build_groups(g)
    w1, w2, x = (leaf(g, "['w1']"), leaf(g, "['w2']"), g.leaves(Role.BATCH)[0].tensor)
    assert groups.of(w1, 1) == groups.of(w2, 0)  # W1's outputs are W2's inputs
    assert groups.of(w1, 0) == groups.of(x, 1)
    batch = groups.groups[groups.of(x, 0)]
    assert batch.batch and batch.divisor == 4 and batch.splittable
    hidden = groups.groups[groups.of(w1, 1)]
    assert hidden.divisor == 32 and hidden.reduced and not hidden.conflicted
    assert {p for p, _ in hidden.param_dims} == {"[0]['w1']", "[0]['w2']"}


def test_transformer_heads_apart_from_hidden_and_the_batch_found():
    g, groups = gpt()
    q = leaf(g, "layer_0']['attention']['query']['kernel']")
    o = leaf(g, "layer_0']['attention']['out']['kernel']")
    wi = leaf(g, "layer_0']['mlp']['wi']['kernel']")
    wo = leaf(g, "layer_0']['mlp']['wo']['kernel']")
    hidden, heads = groups.of(q, 0), groups.of(q, 1)
    assert heads != hidden
    assert groups.of(o, 0) == heads and groups.of(o, 1) == hidden  # row-parallel partner
    assert groups.groups[heads].divisor == 4  # the hidden -> heads x head_dim major factor
    assert groups.of(wi, 1) == groups.of(wo, 0) != hidden
    assert groups.groups[hidden].divisor == 64
    tokens = leaf(g, "['tokens']")
    assert groups.batch_groups == (groups.of(tokens, 0),)
    assert groups.groups[groups.of(tokens, 1)].conflicted  # the sequence meets itself in q.k


def test_layer_classes_share_a_decision_across_repeated_layers():
    g, groups = gpt()
    heads = [groups.of(leaf(g, f"layer_{i}']['attention']['query']['kernel']"), 1) for i in (0, 1)]
    ff = [groups.of(leaf(g, f"layer_{i}']['mlp']['wi']['kernel']"), 1) for i in (0, 1)]
    assert heads[0] != heads[1] and ff[0] != ff[1]
    assert groups.groups[heads[0]].layer_class == groups.groups[heads[1]].layer_class
    assert groups.groups[ff[0]].layer_class == groups.groups[ff[1]].layer_class
    assert groups.groups[ff[0]].layer_class != groups.groups[heads[0]].layer_class
    stats = groups.stats()
    assert stats["dims"] > stats["splittable_dims"] > stats["groups"] > stats["decisions"]
    assert stats["decisions_layer_grouped"] < stats["decisions"]
    per_group = expand_classes(groups, {groups.groups[ff[0]].layer_class: "model"})
    assert per_group[ff[0]] == per_group[ff[1]] == "model"
    flat = build_groups(g, layer_grouping=False)
    assert flat.stats()["decisions_layer_grouped"] == flat.stats()["decisions"]


def test_layouts_follow_the_assignment_and_drop_a_repeated_axis():
    g = mlp_graph()
    groups = build_groups(g)
    w1, x = leaf(g, "['w1']"), g.leaves(Role.BATCH)[0].tensor
    hidden_in, hidden = groups.of(w1, 0), groups.of(w1, 1)
    lay = layouts(g, groups, {hidden: "model", groups.of(x, 0): "data"})
    assert lay[w1] == (None, "model") and lay[x] == ("data", None)
    # One axis on both dims of W1: the dim whose group id is smaller keeps it.
    lay = layouts(g, groups, {hidden_in: "model", hidden: "model"})
    keep = 0 if hidden_in < hidden else 1
    assert lay[w1][keep] == "model" and lay[w1][1 - keep] is None


def test_plan_from_assignment_specs_out_specs_constraints():
    g, groups = gpt()
    ff = groups.of(leaf(g, "layer_0']['mlp']['wi']['kernel']"), 1)
    mesh = {"data": 2, "model": 4}
    plan = plan_from_assignment(
        g, groups, mesh, {groups.batch_groups[0]: "data", ff: "model"}, name="t"
    )
    assert plan.specs["[0]['params']['layer_0']['mlp']['wi']['kernel']"] == (None, "model")
    assert plan.specs["[2]['tokens']"] == ("data", None)
    # New params and optimizer state leave with the specs they came in with.
    for path, spec in plan.specs.items():
        if path in plan.out_specs:
            assert plan.out_specs[path] == spec
    assert plan.constraints and all(
        len(s) == g.tensors[t].ndim for t, s in plan.constraints.items()
    )
    assert plan.assignment == {groups.batch_groups[0]: "data", ff: "model"}
    # A split the group cannot take (4 heads on 8 devices) is dropped, not applied.
    heads = groups.of(leaf(g, "layer_0']['attention']['query']['kernel']"), 1)
    plan = plan_from_assignment(g, groups, {"model": 8}, {heads: "model"})
    assert plan.assignment == {}


def test_zero_adds_the_data_axis_to_optimizer_state_and_params():
    g, groups = gpt()
    mesh = {"data": 2, "model": 4}
    ff = groups.of(leaf(g, "layer_0']['mlp']['wi']['kernel']"), 1)
    z1 = plan_from_assignment(g, groups, mesh, {ff: "model"}, zero_stage=1, zero_gather="params")
    z3 = plan_from_assignment(g, groups, mesh, {ff: "model"}, zero_stage=3)
    kernel = "[0]['params']['layer_0']['mlp']['wi']['kernel']"
    assert z1.specs[kernel] == (None, "model") and z3.specs[kernel] == ("data", "model")
    # This GPT computes in bf16 from float32 parameters: by default ZeRO-1 keeps its float32
    # masters on the data shards too and gathers the bf16 casts (`_groups/_mixed.py`).
    mixed = plan_from_assignment(g, groups, mesh, {ff: "model"}, zero_stage=1)
    assert mixed.zero_gather == "compute" and mixed.specs[kernel] == ("data", "model")
    opt = [x.path for x in g.leaves(Role.OPT_STATE) if g.tensors[x.tensor].ndim == 2]
    assert opt and all("data" in z1.specs[p] for p in opt)
    assert zero_spec((None,), (3,), mesh, "data") == (None,)  # nothing divisible: left alone
    assert zero_spec(("model",), (16,), mesh, "data") == (("model", "data"),)


@pytest.mark.parametrize("layer_grouping", [True, False])
def test_groups_cover_every_dim_once(layer_grouping):
    g, _ = gpt()
    groups = build_groups(g, layer_grouping=layer_grouping)
    seen = [m for grp in groups.groups for m in grp.members]
    assert len(seen) == len(set(seen)) == sum(t.ndim for t in g.tensors)
    for grp in groups.groups:
        for t, d in grp.members:
            assert groups.of(t, d) == grp.id
            assert g.tensors[t].shape[d] % grp.divisor == 0


def test_a_flatten_cuts_the_batch_between_convolutions_and_dense_layers():
    graph, groups = cnn()
    images, labels = (leaf.tensor for leaf in graph.leaves(Role.BATCH))
    conv_batch, dense_batch = groups.of(images, 0), groups.of(labels, 0)
    assert conv_batch != dense_batch
    assert set(groups.batch_groups) == {conv_batch, dense_batch} and groups.batch_size == 16
    # The forward flatten and its transpose in the backward pass, one seam each way.
    assert {(s.before, s.after) for s in groups.seams} == {
        (conv_batch, dense_batch),
        (dense_batch, conv_batch),
    }
    for seam in groups.seams:
        op = graph.ops[seam.op]
        assert op.primitive == "reshape"
        assert groups.of(op.inputs[0], 0) == seam.before
        assert groups.of(op.outputs[0], 0) == seam.after
    _, whole = cnn(seams=False)
    assert len(whole.batch_groups) == 1 and not whole.seams


def test_a_transformer_has_no_seam():
    _, groups = gpt()
    assert not groups.seams and len(groups.batch_groups) == 1
