"""Third-party models as their users write them: Hugging Face Flax BERT (masked LM, optax
Adam) and Keras-Hub GPT-2 (causal LM, Keras's stateless JAX loop), built from configs with
random weights. Each is captured, planned, applied and checked against the one-device
step on 8 CPU devices, and one plan of each is compiled for 8 A100s and held against the
cost model. `make` installs transformers and keras-hub (pyproject's thirdparty pins): a
missing package fails these tests, it does not skip them."""

import jax
import pytest

import automap as am
from automap._groups import build_groups, residual_group, sequence_dims, state_inputs
from automap._verify import verify

CPU8 = am.Cluster.preset("cpu", devices=8)
A100 = am.Cluster.preset("a100", devices=8)
# Smaller than the examples' defaults, to keep each test to seconds.
TINY = {
    "examples.hf_bert": dict(
        batch=16,
        seq=32,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
    ),
    "examples.keras_gpt2": dict(
        batch=16,
        seq=32,
        vocabulary_size=256,
        hidden_dim=64,
        intermediate_dim=128,
        num_layers=1,
    ),
}


def _make(module: str, **kw):
    import importlib

    return importlib.import_module(module).make_step(**TINY[module], **kw)


@pytest.mark.parametrize("module", list(TINY))
def test_a_third_party_step_plans_and_computes_what_it_computes_unsharded(module):
    step, args = _make(module)
    graph = am.capture(step, *args)
    roles = {leaf.arg_index: leaf.role for leaf in graph.inputs}
    assert roles[0] == am.Role.PARAM and roles[len(args) - 1] == am.Role.BATCH
    # Megatron x data (4 x 2): the batch split and the blocks' heads, MLP and vocabulary
    # split, the partial sums all-reduced; run, it computes what the unsharded step does.
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=2, dp=4), cluster=CPU8)
    assert plan.mesh == {"data": 4, "model": 2} and len(plan.assignment) > 1
    report = verify(step, plan, *args)
    assert report.numerics_ok, report.max_abs_err


@pytest.mark.gpu_compile
@pytest.mark.parametrize("module", list(TINY))
@pytest.mark.parametrize("donate", [False, True])
def test_a_third_party_step_compiled_for_a100s_is_priced_as_xla_builds_it(module, donate):
    # Data parallel on 8 A100s: the gradients' all-reduce (the tied word embedding's two
    # partial sums added before one reduction) to the byte, and the peak within 15% of
    # XLA's buffer assignment, whether the step writes its new state over the old
    # (donating) or beside it.
    step, args = _make(module, donate=donate)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=8), cluster=A100)
    report = verify(step, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)
    assert (report.xla_memory_breakdown["aliased"] > 0) == donate


def test_a_keras_steps_new_optimizer_variables_keep_their_shards():
    # Keras's stateless step takes its variables and its optimizer's as two lists and
    # returns them at other positions: `[3][j]`, past its position, names both `[0][j]`
    # and `[2][j]`. Matched leaf by leaf, half the new moments had no input and left
    # replicated under ZeRO-1: XLA gathered them (the data all-gather 1.6x the priced).
    step, args = _make("examples.keras_gpt2")
    graph = am.capture(step, *args)
    state = state_inputs(graph)
    news = [leaf.path for leaf in graph.outputs if leaf.path.startswith(("[1]", "[3]"))]
    assert news and all(path in state for path in news)
    assert all(state[p].path == "[2]" + p[3:] for p in news if p.startswith("[3]"))
    plan = am.expert_plans(step, *args, cluster=CPU8)["zero1"]
    moments = [p for p in news if p.startswith("[3]") and graph.tensors[state[p].tensor].ndim]
    assert all("data" in jax.tree.leaves(tuple(plan.out_specs[p])) for p in moments)


def test_a_keras_gpt2s_sequence_parallelism_splits_the_sequence():
    # Keras-Hub ties its position table's rows (the sequence) to more tensor dims than the
    # hidden size (its attention reshapes heads apart): chosen by members, the "residual
    # group" of the example's model (660 members to 658) was the sequence, and sequence
    # parallelism split the stream's hidden size.
    import examples.keras_gpt2

    step, args = examples.keras_gpt2.make_step(batch=8, seq=64)
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    residual = residual_group(groups)
    assert residual is not None and ("[0][0]", 1) in residual.param_dims  # the table's width
    dims = sequence_dims(graph, groups)
    assert dims and {graph.tensors[t].shape[d] for t, d in dims.items()} == {64}


@pytest.mark.gpu_compile
@pytest.mark.parametrize("positions, kind", [(32, "all-gather"), (64, "all-reduce")])
def test_positions_looked_up_at_an_iota_are_gathered_on_a_gpu(positions, kind):
    # Hugging Face BERT looks its positions up as take(table, arange(seq)). With the
    # table's rows split (Megatron x data), XLA's GPU partitioner reads an iota as long as
    # the rows as parallel to them: each device looks up its own positions and all-gathers
    # them. A longer table is looked up masked and all-reduced, as any lookup. It was
    # priced as the all-reduce in both (XLA's all-gather missed, the all-reduce over).
    step, args = _make("examples.hf_bert", max_position_embeddings=positions)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=2, dp=4), cluster=A100)
    report = verify(step, plan, *args, target="a100")
    assert report.collectives_match, report.mismatches
    assert ("all-gather@model" in report.xla_comm_bytes) == (kind == "all-gather")
