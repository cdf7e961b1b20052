"""Loops and conditionals priced as XLA compiles them (issue 14, section 3).

Programs written as large JAX codebases write them: layers stacked under `lax.scan`,
under Flax's `nn.scan`, picked by a `fori_loop`'s counter, gradient accumulation in a scan,
a `lax.cond`, and all of these nested (a cond in a scan in a scan, then a while). For each, an
expert plan's predicted collectives (kind, axis and bytes) are the ones XLA's compiled
HLO holds, and the plan's numerics equal the unsharded step's. Before bodies were priced,
each of these disagreed (a whole-tensor all-gather at the loop boundary predicted, the
collectives inside the body missed).
"""

import dataclasses
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from rich.console import Console
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._cost import AR, AxisCosts, CostModel, combined_times
from automap._pipeline import scanned_layers
from automap._report import print_plan
from automap._search import Problem, search_ilp
from automap._space import Pruning, ShardSpace
from automap._verify import axis_of, compile_plan, parse_collectives

B, D, F, L = 16, 32, 64, 4
CLUSTER = am.Cluster.preset("cpu", devices=8)


def _sgd(loss_fn):
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    return step


def _normal(key, *shape):
    return jax.random.normal(key, shape) * 0.1


def _batch(seed, rows):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (rows, D)), jax.random.normal(k2, (rows, D))


def _mlp(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": _normal(k1, D, F), "w2": _normal(k2, F, D)}


def _scan_loss(params, batch):
    x, y = batch
    h, _ = jax.lax.scan(
        lambda h, w: (jnp.tanh(h @ w[0]) @ w[1] + h, None),
        x @ params["embed"],
        (params["w1"], params["w2"]),
    )
    return jnp.mean((h @ params["head"] - y) ** 2)


def scan_program():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    params = {
        "embed": _normal(k[0], D, D),
        "w1": _normal(k[1], L, D, F),
        "w2": _normal(k[2], L, F, D),
        "head": _normal(k[3], D, D),
    }
    return _sgd(_scan_loss), (params, _batch(2, B))


def _indexed_loss(params, batch):
    """Layers picked by the loop counter from the whole stack (a loop-invariant operand),
    as `fori_loop` code writes them."""
    x, y = batch

    def body(i, h):
        return jnp.tanh(h @ params["w1"][i]) @ params["w2"][i] + h

    h = jax.lax.fori_loop(0, L, body, x @ params["embed"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def indexed_program():
    return _sgd(_indexed_loss), scan_program()[1]


def _nested_loss(params, batch):
    x, y = batch

    def layer(h, w):
        def twice(h, _):
            branch = jax.lax.cond(h.sum() > 0, lambda h: jnp.tanh(h @ w[0]) @ w[1], lambda h: h, h)
            return branch, None

        return jax.lax.scan(twice, h, None, length=2)[0], None

    h, _ = jax.lax.scan(layer, x @ params["embed"], (params["w1"], params["w2"]))
    return jnp.mean((h @ params["head"] - y) ** 2)


def nested_step(params, batch):
    params, loss = _sgd(_nested_loss)(params, batch)

    def halve(c):  # a while loop without a static trip count
        return c[0] + 1, c[1] @ params["embed"] * 0.5

    _, head = jax.lax.while_loop(lambda c: c[1].sum() > 1e9, halve, (0, params["head"]))
    return {**params, "head": head}, loss


def nested_program():
    return nested_step, scan_program()[1]


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.Dense(D, use_bias=False)(jnp.tanh(nn.Dense(F, use_bias=False)(h))) + h, None


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        h, _ = layers(name="layers")(x, None)
        return h


def nn_scan_program():
    model = _Stack()
    x, y = _batch(3, B)
    params = model.init(jax.random.PRNGKey(4), x)["params"]

    def loss(params, batch):
        return jnp.mean((model.apply({"params": params}, batch[0]) - batch[1]) ** 2)

    return _sgd(loss), (params, (x, y))


def _mlp_loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def accumulate_step(params, batch, micro=4):
    xs = jax.tree.map(lambda a: a.reshape(micro, a.shape[0] // micro, *a.shape[1:]), batch)

    def body(acc, mb):
        return jax.tree.map(jnp.add, acc, jax.value_and_grad(_mlp_loss)(params, mb)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zero, xs)
    return jax.tree.map(lambda p, g: p - 0.01 * g / micro, params, grads), loss / micro


def accumulate_program():
    return accumulate_step, (_mlp(5), _batch(6, 4 * B))


def _cond_loss(params, batch):
    x, y = batch
    h = jax.lax.cond(jnp.sum(y) > 0, jnp.tanh, jax.nn.relu, x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def cond_program():
    return _sgd(_cond_loss), (_mlp(7), _batch(8, B))


PROGRAMS = {
    "scan": scan_program,
    "indexed": indexed_program,
    "nn_scan": nn_scan_program,
    "nested": nested_program,
    "accumulate": accumulate_program,
    "cond": cond_program,
}
CASES = [
    ("scan", "data_parallel"),
    ("scan", "megatron"),
    ("scan", "megatron_dp"),  # splits the stacked layer dim: gathered for each scan
    # The stack split on its layer dim, read whole by every trip: XLA gathers it once,
    # hoisted out of both loops (forward and backward), not once per trip.
    ("indexed", "megatron_dp"),
    ("nn_scan", "data_parallel"),
    ("nn_scan", "megatron_dp"),
    # ("accumulate", "megatron"): test_accumulation_prices_the_body_collective_per_trip
    ("accumulate", "megatron_dp"),
    ("nested", "megatron_dp"),
    ("cond", "data_parallel"),
    ("cond", "megatron"),
]


# The nested program's while loop has no static trip count: capture says so, as it should.
@pytest.mark.slow  # loop programs compiled (7-23 s each loaded)
@pytest.mark.filterwarnings("ignore:automap. a while loop")
@pytest.mark.parametrize(("program", "expert"), CASES)
def test_loop_plans_predict_xla_collectives(program, expert):
    step, args = PROGRAMS[program]()
    plan = am.expert_plans(step, *args, cluster=CLUSTER)[expert]
    report = am.verify(step, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok, report.summary()
    # Not vacuous: the plan communicates, and what it moves is what XLA moves.
    assert sum(report.xla_comm_bytes.values()) > 0


def test_accumulation_prices_the_body_collective_per_trip():
    """Megatron under gradient accumulation: the row-parallel matmul's partial sums are
    all-reduced over `model` inside the scan body, once per microbatch (4 trips): the
    plan predicted no communication at all when the loop was one opaque op."""
    step, args = accumulate_program()
    plan = am.expert_plans(step, *args, cluster=CLUSTER)["megatron"]
    report = am.verify(step, plan, *args)
    per_trip = 2 * (B * D * 4)  # forward activations and backward input gradient, f32
    assert report.predicted_comm_bytes["all-reduce@model"] >= 4 * per_trip
    assert report.collectives_match, report.summary()


@pytest.mark.parametrize(
    ("program", "expert"),
    [("scan", "data_parallel"), ("scan", "megatron_dp"), ("nn_scan", "data_parallel")],
)
def test_body_gradient_all_reduces_are_combined_per_trip(program, expert):
    """XLA's all-reduce combiner runs on the while body: a scanned layer's weight-gradient
    all-reduces become one tuple all-reduce per trip (L in all), next to the one the
    step's other gradients make after the loop. The model charged each body gradient its
    own latency (2 per trip: 10 all-reduces for the scan program's 5)."""
    step, args = PROGRAMS[program]()
    plan = am.expert_plans(step, *args, cluster=CLUSTER)[expert]
    hlo = parse_collectives(compile_plan(step, plan, args)[1].as_text())
    ar_of = [(c, axis_of(c.kind, c.groups, plan.mesh)) for c in hlo if c.kind == "all-reduce"]
    data = [c for c, axis in ar_of if axis == "data"]
    in_loop = [c for c in data if c.count > 1]
    assert len(in_loop) == 1 and in_loop[0].count == L  # one tuple all-reduce per trip
    model = CostModel(am.capture(step, *args), CLUSTER)
    st = model.state(model.plan_assignment(plan), plan.mesh)
    ac = AxisCosts(CLUSTER, plan.mesh)
    _, g_bytes, calls = combined_times(st.sums, ac, model.tables.combine_trips)
    key = AR * ac.masks + int(ac.bit[list(plan.mesh).index("data") + 1])
    # Slot 0: the step's gradients, after the loop; slot 1: the scan's backward body.
    assert calls[1:, key].tolist() == [L]
    assert g_bytes[1:, key].tolist() == [in_loop[0].bytes * L]
    assert calls[0, key] <= 1  # outside the loop: one combined, as before
    out = [c for c in data if c.count == 1]
    assert g_bytes[0, key] + st.sums[1, key] == sum(c.bytes for c in out)
    cost = model.estimate(plan)
    (ar,) = [c for c in cost.collectives if (c.kind, c.axis) == ("all-reduce", "data")]
    assert ar.bytes == sum(c.bytes * c.count for c in data)
    # Known gap, outside loops as before: XLA also folds the loss' scalar sum into the
    # step's gradient tuple, which the model prices as its own all-reduce.
    assert ar.count == L + calls[0, key] + st.sums[2, key]
    assert ar.count - sum(c.count for c in data) == st.sums[2, key] * calls[0, key]


def test_delta_on_body_gradients_equals_a_full_evaluation():
    """Moving groups one at a time onto and off the axes (incremental sums, the body's
    combine slot included) prices a plan as evaluating it whole does."""
    step, args = scan_program()
    plan = am.expert_plans(step, *args, cluster=CLUSTER)["megatron_dp"]
    model = CostModel(am.capture(step, *args), CLUSTER)
    target = model.plan_assignment(plan)
    base, current = model.state({}, plan.mesh), {}
    for gid, axis in target.items():
        cost, base = model.evaluate_delta(base, {gid: axis})
        current[gid] = axis
        full = model.evaluate(current, plan.mesh)
        assert cost.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
        assert [(c.kind, c.axis, c.count) for c in cost.collectives] == [
            (c.kind, c.axis, c.count) for c in full.collectives
        ]
        assert [c.bytes for c in cost.collectives] == pytest.approx(
            [c.bytes for c in full.collectives]
        )
    back, _ = model.evaluate_delta(base, {gid: None})
    del current[gid]
    assert back.step_time_s == pytest.approx(model.evaluate(current, plan.mesh).step_time_s)
    assert model.tables.combine_trips.tolist() == [1.0, L]


def test_loop_bodies_are_captured_and_bound():
    """Each loop op keeps its body as a program bound to its operands: a scan slices its
    stacked weights along their leading dim, and a cond prices its dearest branch."""
    graph = am.capture(*_unpack(scan_program()))
    scans = [op for op in graph.ops if op.primitive == "scan"]
    assert scans and all(graph.bodies[op.index] for op in scans)
    body = graph.bodies[scans[0].index][0]
    assert body.trips == L
    stacked = {
        (graph.tensors[o].shape, body.graph.tensors[i].shape, off) for o, i, off in body.binds
    }
    assert ((L, D, F), (D, F), 1) in stacked
    graph = am.capture(*_unpack(cond_program()))
    for op in graph.ops:
        if op.primitive == "cond":
            assert sum(b.priced for b in graph.bodies[op.index]) == 1


def _unpack(program):
    step, args = program
    return (step, *args)


# ---- a scanned layer stack, planned like the unrolled one (issue 14, section 3) ---------
# Sizes where tensor parallelism pays (wide layers, few tokens): the ILP splits inside the
# layers, so the comparison sees real per-layer choices, not data parallelism alone.
TB, TS, TD, TH, TF, TL, TV = 8, 8, 256, 4, 1024, 4, 256


def _norm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


def _block(h, w):
    """A pre-norm transformer block; w holds one layer's weights."""
    q, k, v = (jnp.einsum("bsd,dhe->bshe", _norm(h), w[n]) for n in ("wq", "wk", "wv"))
    att = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / (TD // TH) ** 0.5, axis=-1)
    h = h + jnp.einsum("bhqk,bkhe,hed->bqd", att, v, w["wo"])
    return h + jax.nn.gelu(_norm(h) @ w["w1"]) @ w["w2"]


def _lm_loss(params, h, labels):
    logp = jax.nn.log_softmax(_norm(h) @ params["embed"].T)
    return -jnp.take_along_axis(logp, labels[..., None], -1).mean()


def _scanned_lm(params, batch):
    tokens, labels = batch
    h, _ = jax.lax.scan(
        lambda h, w: (_block(h, w), None), params["embed"][tokens], params["layers"]
    )
    return _lm_loss(params, h, labels)


def _unrolled_lm(params, batch):
    tokens, labels = batch
    h = params["embed"][tokens]
    for w in params["layers"]:
        h = _block(h, w)
    return _lm_loss(params, h, labels)


def _layer_shapes(*lead):
    f32 = lambda *s: jax.ShapeDtypeStruct((*lead, *s), jnp.float32)  # noqa: E731
    return {
        **{n: f32(TD, TH, TD // TH) for n in ("wq", "wk", "wv")},
        "wo": f32(TH, TD // TH, TD),
        "w1": f32(TD, TF),
        "w2": f32(TF, TD),
    }


def _lm_args(layers):
    tokens = jax.ShapeDtypeStruct((TB, TS), jnp.int32)
    embed = jax.ShapeDtypeStruct((TV, TD), jnp.float32)
    return {"embed": embed, "layers": layers}, (tokens, tokens)


def _ilp_without_zero(step, args):
    problem = Problem.build(step, args, CLUSTER, None)
    space = ShardSpace(
        problem.graph, problem.groups, problem.cluster, problem.cost_model, Pruning(zero=False)
    )
    point, stats = search_ilp(space, 60.0)
    return dataclasses.replace(space.to_plan(*point, name="ilp"), decisions=stats)


def test_scanned_layers_are_planned_like_unrolled_ones():
    """The ILP gives the scanned stack's body the split it gives every unrolled layer, and
    the same collectives. Before, a loop's compute was one lump divided by whatever split
    its carried tensors had (attention left whole priced as if split 8 ways), and the loop
    tied every group it carries into one ILP scope too large to solve on 2-D meshes: the
    scan got a 1-D plan 12% slower than the unrolled one's."""
    # Without ZeRO: on the unrolled stack it runs the update of a layer's leaves on data
    # shards and wins by 0.2%, where the scan's stacked leaves already take data.
    scanned = _ilp_without_zero(_sgd(_scanned_lm), _lm_args(_layer_shapes(TL)))
    unrolled = _ilp_without_zero(_sgd(_unrolled_lm), _lm_args([_layer_shapes() for _ in range(TL)]))
    assert scanned.decisions["optimal"] and unrolled.decisions["optimal"]
    assert scanned.mesh == unrolled.mesh
    split = [s for s in scanned.specs.values() if any(s)]
    assert any(len({a for a in spec if a}) == 2 for spec in split)  # not data parallel alone
    for name, spec in scanned.specs.items():
        if "['layers']" not in name:
            assert spec == unrolled.specs[name]
            continue
        assert spec[0] is None  # the stacked (layer) dim: each trip takes its slice whole
        for k in range(TL):  # every unrolled layer gets the body's split
            assert unrolled.specs[name.replace("['layers']", f"['layers'][{k}]")] == spec[1:]
    ours, theirs = scanned.predicted, unrolled.predicted
    assert {(c.kind, c.axis, c.bytes, c.count) for c in ours.collectives} == {
        (c.kind, c.axis, c.bytes, c.count) for c in theirs.collectives
    }
    # The same collectives; compute within 10% (each trip's results leave the body for
    # the next trip or the backward pass, written to memory where an unrolled program
    # fuses across layers).
    assert ours.comm_s == pytest.approx(theirs.comm_s, rel=1e-6)
    assert ours.compute_s == pytest.approx(theirs.compute_s, rel=0.10)


# ---- pipelines: layers in one scan cannot be cut, and the planner says so -----------------


@pytest.mark.filterwarnings("ignore:automap. a while loop")
@pytest.mark.parametrize(
    ("program", "path"),
    [
        ("scan", "[0]['w1'], [0]['w2']"),
        ("nn_scan", "[0]['layers']"),
        ("nested", "[0]['w1'], [0]['w2']"),
        ("accumulate", None),  # a scan over microbatches: its parameters are not stacked
        ("cond", None),
    ],
)
def test_scanned_layers_are_found(program, path):
    graph = am.capture(*_unpack(PROGRAMS[program]()))
    stack = scanned_layers(graph)
    if path is None:
        assert stack is None
        return
    assert (stack.path, stack.trips) == (path, L)
    # The forward scan and the backward scan over its residuals: most of the step.
    assert 0.85 < stack.flops_share <= 1.0
    assert graph.ops[stack.op].primitive == "scan"


def test_pipeline_recipe_on_scanned_layers_is_one_line_error(tmp_path, monkeypatch):
    step, args = scan_program()
    with pytest.raises(am.PlanError, match=r"one scan \(op \d+, over .*4 trips, \d+% of"):
        am.plan_recipe(step, *args, recipe=am.Recipe(pp=2, dp=4), cluster=CLUSTER)
    # The same through `automap estimate --pp`, as one line on stderr.
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "scanned_step.py").write_text(
        "import test_loops\n\ndef make():\n    return test_loops.scan_program()\n"
    )
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    args = ["estimate", "--fn", "scanned_step:make", "--cluster", "cpu", "--devices", "8"]
    result = CliRunner().invoke(app, [*args, "--pp", "2", "--dp", "4"])
    assert result.exit_code == 2, result.output
    assert "pp=2 needs stage cuts between layers, but the layers live in one scan" in (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_pipeline_search_notes_scanned_layers(tmp_path):
    """dp and auto search pipelines on a scanned stack (cuts around it only) and say why
    no cut falls between the layers, in the plan's provenance, its file and its printout."""
    step, args = scan_program()
    plan = am.plan(step, *args, cluster=CLUSTER, searcher="dp", budget_s=5)
    (note,) = plan.provenance.notes
    assert "one scan" in note and "4 trips" in note and "Python loop" in note
    assert am.Plan.load(plan.save(tmp_path / "p.json")).provenance.notes == (note,)
    console = Console(width=400, record=True)
    print_plan(console, plan, CLUSTER)
    assert "note: pipelines can only cut around the layers" in console.export_text()
    one_stage = am.plan(step, *args, cluster=CLUSTER, searcher="ilp", budget_s=5)
    assert one_stage.provenance.notes == ()  # no pipelines searched, nothing to say
    step, args = cond_program()  # no stacked layers: nothing to say
    assert am.plan(step, *args, cluster=CLUSTER, searcher="dp", budget_s=5).provenance.notes == ()
