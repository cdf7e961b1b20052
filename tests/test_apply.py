"""apply: sharded runs compute what the unsharded step computes; bad plans refused early."""

import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

from _cases import examples
from automap import ApplyError, Plan, PlanError
from automap._plan import Provenance, Stage
from automap._run import TPU_OVERLAP_FLAGS, apply, compiler_options

OPT = optax.adam(1e-2)


def mlp_step(params, opt_state, batch):
    def loss_fn(p):
        h = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def mlp_args(batch=16, d_in=32, d_hidden=64, d_out=16):
    k = iter(jax.random.split(jax.random.key(0), 6))
    params = {
        "w1": jax.random.normal(next(k), (d_in, d_hidden)) / np.sqrt(d_in),
        "b1": jnp.zeros((d_hidden,)),
        "w2": jax.random.normal(next(k), (d_hidden, d_out)) / np.sqrt(d_hidden),
        "b2": jnp.zeros((d_out,)),
    }
    batch = {
        "x": jax.random.normal(next(k), (batch, d_in)),
        "y": jax.random.normal(next(k), (batch, d_out)),
    }
    return params, OPT.init(params), batch


def specs_for(args, rule):
    """A spec per input leaf: rule(path, leaf) -> spec."""
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    return {jax.tree_util.keystr(p): tuple(rule(jax.tree_util.keystr(p), x)) for p, x in flat}


def megatron_rule(data, model):
    def rule(path, x):
        if "['x']" in path or "['y']" in path:
            return (data, None)
        if "['w1']" in path or "['b1']" in path:  # column-parallel: output features split
            return (None, model) if x.ndim == 2 else (model,)
        if "['w2']" in path:  # row-parallel: input features split
            return (model, None)
        return (None,) * x.ndim

    return rule


def assert_same(got, want, rtol=1e-5, atol=1e-6):
    got_l, got_t = jax.tree_util.tree_flatten(got)
    want_l, want_t = jax.tree_util.tree_flatten(want)
    assert got_t == want_t
    for g, w in zip(got_l, want_l, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    ("mesh", "data", "model"),
    [
        ({"data": 8}, "data", None),
        ({"model": 8}, None, "model"),
        ({"data": 2, "model": 4}, "data", "model"),
    ],
    ids=["data_parallel", "megatron", "data2_model4"],
)
def test_mlp_train_step_matches_unsharded(mesh, data, model):
    args = mlp_args()
    plan = Plan(mesh=mesh, specs=specs_for(args, megatron_rule(data, model)))
    want = jax.jit(mlp_step)(*args)
    step = apply(mlp_step, plan)
    assert_same(step(*args), want)
    assert_same(step(*args), want)  # second call: the cached executable


def test_numpy_args_and_out_specs():
    args = jax.tree.map(np.asarray, mlp_args())
    specs = specs_for(args, megatron_rule("data", "model"))
    out_specs = {"[1]['w1']": (None, "model"), "[0]": ()}
    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs, out_specs=out_specs)
    loss, params, _ = apply(mlp_step, plan)(*args)
    assert_same((loss, params), jax.jit(mlp_step)(*args)[:2])
    assert params["w1"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert len(params["w1"].sharding.device_set) == 8


def test_a_training_loop_feeding_back_placed_state_moves_only_the_new_batch(monkeypatch):
    """The step's own outputs come back laid out as planned: only the batch is placed
    again (device_put costs host time a leaf even when it moves nothing), and the
    second step computes what the unsharded loop computes."""
    args = mlp_args()
    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs_for(args, megatron_rule("data", "model")))
    step = apply(mlp_step, plan)
    _, params, opt = step(*args)
    put = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **k: put.append(x) or real(x, s, **k))
    batch = jax.tree.map(np.asarray, args[2])  # a fresh host batch, as a data loader gives
    got = step(params, opt, batch)
    assert len(put) == 1 and len(put[0]) == len(jax.tree_util.tree_leaves(batch))
    want_params, want_opt = jax.jit(mlp_step)(*args)[1:]
    assert_same(got, jax.jit(mlp_step)(want_params, want_opt, args[2]), rtol=1e-4, atol=1e-5)


def test_subset_of_devices():
    args = mlp_args()
    plan = Plan(mesh={"data": 2, "model": 2}, specs=specs_for(args, megatron_rule("data", "model")))
    step = apply(mlp_step, plan, devices=jax.devices()[4:])
    loss = step(*args)[0]
    assert loss.sharding.device_set == set(jax.devices()[4:])
    assert_same(loss, jax.jit(mlp_step)(*args)[0])


# ---- refusals: each before anything runs -------------------------------------------


def counting(fn):
    calls = []

    def wrapped(*a):
        calls.append(1)  # runs at trace time: a refusal must come before any tracing
        return fn(*a)

    return wrapped, calls


def test_too_many_devices():
    plan = Plan(mesh={"data": 16}, specs={})
    with pytest.raises(ApplyError, match=r"needs 16 devices.*only 8 are present.*8 devices"):
        apply(mlp_step, plan)
    # One device present: said in the singular (a plan for one device, not "1 devices").
    with pytest.raises(ApplyError, match=r"needs 16 devices.*only 1 is present.* 1 device \("):
        apply(mlp_step, plan, devices=jax.devices()[:1])


def test_pipeline_plan_specs_name_the_stage_mesh():
    # Pipeline plans run (tests/pipeline); their specs may not name the "pipe" axis.
    stages = (Stage(0, 5, (0, 1, 2, 3), {"data": 4}), Stage(5, 9, (4, 5, 6, 7), {"data": 4}))
    plan = Plan(mesh={"pipe": 2, "data": 4}, specs={"[0]['w1']": ("pipe", None)}, stages=stages)
    with pytest.raises(PlanError, match="pipeline stage's mesh"):
        apply(mlp_step, plan)


def test_unknown_axis_and_repeated_axis():
    args = mlp_args()
    specs = specs_for(args, megatron_rule("data", "model"))
    with pytest.raises(PlanError, match=r"mesh axes \['model'\]"):
        apply(mlp_step, Plan(mesh={"data": 8}, specs=specs))
    specs = specs_for(args, megatron_rule("data", None))
    specs["[0]['w1']"] = ("data", "data")
    with pytest.raises(PlanError, match="one mesh axis twice"):
        apply(mlp_step, Plan(mesh={"data": 8}, specs=specs))


def test_paths_differ():
    args = mlp_args()
    specs = specs_for(args, megatron_rule("data", None))
    specs["[0]['w3']"] = specs.pop("[0]['w2']")
    fn, calls = counting(mlp_step)
    with pytest.raises(PlanError, match=r"another program.*\['w3'\].*\['w2'\]"):
        apply(fn, Plan(mesh={"data": 8}, specs=specs))(*args)
    assert not calls


def test_not_divisible():
    args = mlp_args(d_hidden=60)
    fn, calls = counting(mlp_step)
    plan = Plan(mesh={"model": 8}, specs=specs_for(args, megatron_rule(None, "model")))
    with pytest.raises(
        ApplyError, match=r"\['b1'\]: dimension 0 of size 60 is not divisible by 8.*'model'"
    ):
        apply(fn, plan)(*args)
    assert not calls


def test_spec_longer_than_tensor():
    args = mlp_args()
    specs = specs_for(args, megatron_rule("data", None))
    specs["[0]['b1']"] = (None, None)
    with pytest.raises(ApplyError, match="has 1 dimensions"):
        apply(mlp_step, Plan(mesh={"data": 8}, specs=specs))(*args)


def test_unknown_output_path():
    args = mlp_args()
    plan = Plan(
        mesh={"data": 8}, specs=specs_for(args, megatron_rule("data", None)), out_specs={"[7]": ()}
    )
    with pytest.raises(PlanError, match="does not return"):
        apply(mlp_step, plan)(*args)


def test_fingerprint_of_another_program():
    args = mlp_args()
    plan = Plan(
        mesh={"data": 8},
        specs=specs_for(args, megatron_rule("data", None)),
        provenance=Provenance(fingerprint="0123456789abcdef"),
    )
    with pytest.raises(PlanError, match="another program"):
        apply(mlp_step, plan)(*args)


def test_internal_constraints_and_matching_fingerprint():
    from automap._capture import capture

    args = mlp_args()
    graph = capture(mlp_step, *args)
    hidden = [t.id for t in graph.tensors if t.shape == (16, 64) and t.producer is not None]
    plan = Plan(
        mesh={"data": 2, "model": 4},
        specs=specs_for(args, megatron_rule("data", "model")),
        constraints={hidden[0]: ("data", "model"), hidden[-1]: (None, "model")},
        provenance=Provenance(fingerprint=graph.fingerprint),
    )
    step = apply(mlp_step, plan)
    assert_same(step(*args), jax.jit(mlp_step)(*args))
    bad = Plan(mesh=plan.mesh, specs=plan.specs, constraints={len(graph.tensors): ()})
    with pytest.raises(PlanError, match="constrains tensor"):
        apply(mlp_step, bad)(*args)


# ---- property: random small programs under random valid plans -------------------------

MESHES = [{"a": 8}, {"a": 2, "b": 4}, {"a": 4, "b": 2}, {"a": 2, "b": 2, "c": 2}]


def chain_step(ws, x):
    def loss_fn(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    loss, grads = jax.value_and_grad(loss_fn)(ws)
    return loss, [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]


@st.composite
def program_and_plan(draw):
    widths = draw(st.lists(st.sampled_from([4, 8, 12, 16]), min_size=2, max_size=4))
    batch = draw(st.sampled_from([4, 8, 16]))
    mesh = draw(st.sampled_from(MESHES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    ws = [
        rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a)
        for a, b in itertools.pairwise(widths)
    ]
    x = rng.normal(size=(batch, widths[0])).astype(np.float32)
    args = (ws, x)
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        spec, used = [], set()
        for size in leaf.shape:
            ok = [None] + [a for a, n in mesh.items() if size % n == 0 and a not in used]
            axis = draw(st.sampled_from(ok))
            used.add(axis)
            spec.append(axis)
        specs[jax.tree_util.keystr(path)] = tuple(spec)
    return args, Plan(mesh=mesh, specs=specs)


@settings(max_examples=examples(full=8, quick=3), deadline=None)
@given(program_and_plan())
def test_random_programs_random_plans(case):
    args, plan = case
    assert_same(apply(chain_step, plan)(*args), jax.jit(chain_step)(*args), rtol=1e-5, atol=1e-5)


# ---- a zoo transformer, once the zoo exists -----------------------------------------


@pytest.mark.slow
def test_bert_two_layers_megatron_dp():
    from automap._zoo import get_model

    model = get_model(
        "bert-base", layers=2, hidden=64, heads=4, seq=16, batch=8, vocab=128, dtype="float32"
    )
    args = model.concrete_args(0)
    column = ("['query']", "['key']", "['value']", "['wi']")  # output features split
    row = ("['attention']['out']", "['wo']")  # input features split: partial sums

    def rule(path, x):
        if path.startswith("[2]"):  # the batch: sequences on "data"
            return ("data",) + (None,) * (x.ndim - 1)
        if any(k in path for k in column):
            return (None,) * (x.ndim - 1) + ("model",)
        if any(k in path for k in row) and path.endswith("['kernel']"):
            return ("model", None)
        return (None,) * x.ndim

    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs_for(args, rule))
    assert sum("model" in spec for spec in plan.specs.values()) == 3 * 2 * 10  # params, mu, nu
    got = apply(model.step_fn, plan)(*args)
    want = jax.jit(model.step_fn)(*args)

    # The key bias has a zero gradient in exact arithmetic (softmax ignores a per-query
    # constant), so its float-noise gradient is what Adam normalizes: the new value is
    # noise of size lr. It is held to that; everything else to reassociation error.
    def strip(tree, noisy):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return [x for p, x in leaves if ("['key']['bias']" in jax.tree_util.keystr(p)) == noisy]

    assert_same(strip(got, False), strip(want, False), rtol=1e-4, atol=1e-5)
    assert_same(strip(got, True), strip(want, True), rtol=0, atol=2e-4)


def test_only_tpu_programs_are_compiled_with_xlas_tpu_overlap_flags():
    # The runtime jits a plan's programs with XLA's async collective fusion flags on TPUs
    # (tests/test_schedule.py reads what they do); a CPU's (or GPU's) jit gets no options
    # at all, so its program is exactly what jax.jit compiles (a TPU flag errors there).
    cpus = jax.devices("cpu")
    assert compiler_options(jax.sharding.Mesh(np.array(cpus[:2]), ("data",))) is None
    assert all(flag.startswith("xla_") and on == "true" for flag, on in TPU_OVERLAP_FLAGS.items())
    with pytest.raises(Exception, match="xla_tpu_enable_async_collective_fusion"):
        jax.jit(lambda x: x + 1, compiler_options=dict(TPU_OVERLAP_FLAGS)).lower(1.0).compile()
