"""Capture: op order with calls inlined, loops as one op, roles, fingerprints, errors."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from jax import lax
from jax.extend.core import Primitive

import automap as am
from automap._capture import CaptureWarning, capture
from automap._graph import Role, TensorKind
from automap._zoo import get_model

S = jax.ShapeDtypeStruct
F32 = jnp.float32


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def _nested(x, w):
    y = jax.jit(lambda a: a @ w)(x)  # [4, 8]
    y = jax.nn.relu(y)  # custom_jvp around a jit
    y = jax.checkpoint(lambda a: jnp.tanh(a) * 2.0)(y)
    return _sin(y).sum()


def test_calls_are_inlined_in_program_order():
    g = capture(_nested, S((4, 8), F32), S((8, 8), F32))
    prims = [op.primitive for op in g.ops]
    assert prims == ["dot_general", "max", "tanh", "mul", "sin", "reduce_sum"]
    # Each op reads what the previous one wrote: the inlined bodies are wired through.
    for prev, op in zip(g.ops, g.ops[1:], strict=False):
        assert prev.outputs[0] in op.inputs
        assert g.tensors[prev.outputs[0]].producer == prev.index
    assert g.inputs[0].tensor in g.ops[0].inputs and g.inputs[1].tensor in g.ops[0].inputs
    assert g.ops[0].flops == 2 * 4 * 8 * 8
    # Literals (relu's 0.0, the 2.0) are CONST tensors with their values kept.
    consts = [t for t in g.tensors if t.kind is TensorKind.CONST]
    assert len(consts) == 2 and all(t.id in g.const_values for t in consts)
    assert g.outputs[0].tensor == g.ops[-1].outputs[0]


def test_grad_of_custom_rules_and_gelu_inline():
    def loss(w, x):
        return jax.nn.gelu(_sin(jax.nn.relu(x @ w))).sum()

    g = capture(jax.grad(loss), S((8, 8), F32), S((4, 8), F32))
    names = {op.primitive for op in g.ops}
    assert not names & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2"}
    assert sum(op.primitive == "dot_general" for op in g.ops) == 2  # forward + dW
    assert all(op.known for op in g.ops)


def test_scan_is_one_op_costing_body_times_length():
    def body(c, _):
        return jnp.tanh(c @ c), None

    def once(c):
        return body(c, None)[0]

    def looped(c):
        return lax.scan(body, c, None, length=5)[0]

    c = S((16, 16), F32)
    (op,) = capture(looped, c).ops
    assert op.primitive == "scan" and op.trip_count == 5
    one = capture(once, c)
    assert op.flops == 5 * one.total_flops
    assert op.bytes_read == 5 * sum(o.bytes_read for o in one.ops)


def test_cond_costs_its_dearest_branch():
    def fn(p, x):
        return lax.cond(p, lambda v: v @ v, lambda v: v + 1.0, x)

    ops = capture(fn, S((), jnp.bool_), S((8, 8), F32)).ops
    (op,) = [o for o in ops if o.primitive == "cond"]
    assert op.flops == 2 * 8**3


def test_while_without_static_trip_count_warns_once():
    def fn(x):
        x = lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v + 1.0, x)
        return lax.while_loop(lambda v: v.sum() < 20.0, lambda v: v * 2.0, x)

    with pytest.warns(CaptureWarning, match="no static trip count") as record:
        g = capture(fn, S((3,), F32))
    assert len(record) == 1  # once per capture, not once per loop
    assert [op.trip_count for op in g.ops] == [1, 1]


def test_counted_while_is_multiplied():
    def fn(x):
        return lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (op,) = capture(fn, S((10,), F32)).ops
    assert op.trip_count == 6
    assert op.flops == 6 * (1 + 10 + 1)  # counter add, body mul, the test


# A primitive with no cost rule, as a third-party library might define.
_mystery_p = Primitive("automap_test_mystery")
_mystery_p.def_abstract_eval(lambda x: x)
_mystery_p.def_impl(lambda x: x)


def test_unknown_primitive_warns_once_and_is_conservative():
    def fn(x):
        return _mystery_p.bind(_mystery_p.bind(x) * 2.0)

    with pytest.warns(CaptureWarning, match="automap_test_mystery") as record:
        g = capture(fn, S((4, 8), F32))
    assert len(record) == 1
    unknown = [op for op in g.ops if op.primitive == "automap_test_mystery"]
    assert len(unknown) == 2 and not any(op.known for op in unknown)
    assert unknown[0].flops == 10 * 32 and unknown[0].bytes_read == unknown[0].bytes_written == 128


def _adam_step(params, opt_state, batch):
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    tx = optax.adam(1e-3)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def _adam_args(abstract=True):
    params = {"w1": jnp.ones((5, 16)), "b1": jnp.zeros(16), "w2": jnp.ones((16, 3))}
    opt_state = optax.adam(1e-3).init(params)
    batch = {"x": jnp.ones((8, 5)), "y": jnp.ones((8, 3))}
    args = (params, opt_state, batch)
    return jax.eval_shape(lambda a: a, args) if abstract else args


def test_roles_of_a_plain_jax_adam_step():
    g = capture(_adam_step, *_adam_args())
    roles = {leaf.path: leaf.role for leaf in g.inputs}
    assert roles["[0]['w1']"] is Role.PARAM
    assert roles["[1][0].mu['w1']"] is Role.OPT_STATE
    assert roles["[1][0].count"] is Role.OPT_STATE
    assert roles["[2]['x']"] is Role.BATCH
    assert {leaf.arg_index for leaf in g.leaves(Role.OPT_STATE)} == {1}
    assert g.param_count() == 5 * 16 + 16 + 16 * 3
    assert [leaf.path for leaf in g.outputs][:3] == ["[0]['b1']", "[0]['w1']", "[0]['w2']"]


def test_role_overrides_by_index_name_and_path():
    args = _adam_args()
    g = capture(_adam_step, *args, roles={2: "other", "[2]['x']": Role.BATCH, "params": "param"})
    roles = {leaf.path: leaf.role for leaf in g.inputs}
    assert roles["[2]['y']"] is Role.OTHER and roles["[2]['x']"] is Role.BATCH
    assert roles["[0]['w1']"] is Role.PARAM


def test_roles_fallback_without_names():
    # Positional names that say nothing: the first float argument is the parameters.
    fn = lambda a, b: (a["w"] * b).sum()  # noqa: E731
    g = capture(fn, {"w": S((3,), F32)}, S((3,), F32))
    assert [leaf.role for leaf in g.inputs] == [Role.PARAM, Role.OTHER]


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(nn.relu(x).mean(axis=(1, 2)))


def test_flax_train_state_roles_and_conv_step():
    model = _Net()
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 8, 8, 3)), False))
    state = jax.eval_shape(
        lambda v: train_state.TrainState.create(
            apply_fn=model.apply, params=v["params"], tx=optax.adamw(1e-3)
        ),
        variables,
    )

    def step(state, batch_stats, images, labels):
        def loss(p):
            logits, upd = state.apply_fn(
                {"params": p, "batch_stats": batch_stats}, images, True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

        grads, upd = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), upd

    g = capture(step, state, variables["batch_stats"], S((2, 8, 8, 3), F32), S((2,), jnp.int32))
    roles = {leaf.path: leaf.role for leaf in g.inputs}
    assert roles["[0].params['Conv_0']['kernel']"] is Role.PARAM
    assert roles["[0].step"] is Role.OTHER
    assert roles["[2]"] is Role.BATCH and roles["[3]"] is Role.BATCH
    # batch_stats is named like a batch but holds feature statistics: not trained, no batch.
    assert all(r is Role.OTHER for p, r in roles.items() if p.startswith("[1]"))
    assert all(r is Role.OPT_STATE for p, r in roles.items() if p.startswith("[0].opt_state"))
    # Forward and dW: no dx, the images need no gradient.
    assert sum(op.primitive == "conv_general_dilated" for op in g.ops) == 2
    assert all(op.known for op in g.ops)


def test_shape_dtype_struct_inputs_and_key_leaves():
    def fn(params, key):
        noise = jax.random.normal(key, (4, 8), jnp.bfloat16)
        return (noise @ params).astype(F32).sum()

    g = capture(fn, S((8, 2), jnp.bfloat16), jax.eval_shape(lambda: jax.random.key(0)))
    assert g.tensors[g.inputs[0].tensor].shape == (8, 2)
    assert g.tensors[g.inputs[0].tensor].dtype == "bfloat16"
    assert g.inputs[0].role is Role.PARAM and g.inputs[1].role is Role.OTHER
    assert g.in_tree.num_leaves == 2 and g.out_tree.num_leaves == 1
    assert g.jaxpr is not None and len(g.eqns) == len(g.ops)


def test_fingerprint_is_stable_and_shape_sensitive():
    args = _adam_args()
    a = capture(_adam_step, *args).fingerprint
    b = capture(_adam_step, *_adam_args(abstract=False)).fingerprint
    assert a == b and len(a) == 64
    bigger = jax.tree.map(lambda s: S(s.shape, s.dtype), args)
    bigger[2]["x"] = S((16, 5), F32)
    bigger[2]["y"] = S((16, 3), F32)
    assert capture(_adam_step, *bigger).fingerprint != a
    # Same shapes, another program: differs too.
    assert capture(lambda x: jnp.sin(x), S((3,), F32)).fingerprint != (
        capture(lambda x: jnp.cos(x), S((3,), F32)).fingerprint
    )


def test_failing_function_raises_capture_error_with_hint():
    def bad(x, n):
        return jnp.zeros((n,)) + x  # n is traced: not a static shape

    with pytest.raises(am.CaptureError, match=r"functools\.partial"):
        capture(bad, S((3,), F32), 3)
    g = capture(functools.partial(bad, n=3), S((3,), F32))
    assert g.ops


@pytest.mark.slow  # bert-large captured
def test_bert_large_flops_match_the_analytic_count():
    spec = get_model("bert-large")
    g = capture(spec.step_fn, *spec.abstract_args())
    cfg = spec.config
    layers, hidden, batch, seq = cfg["layers"], cfg["hidden"], cfg["batch"], cfg["seq"]
    tokens = batch * seq
    analytic = 6 * g.param_count() * tokens + 3 * 4 * layers * batch * seq**2 * hidden
    matmul = sum(
        op.flops for op in g.ops if op.primitive in ("dot_general", "conv_general_dilated")
    )
    assert abs(matmul - analytic) / analytic < 0.02, (matmul, analytic)
    # Everything else (softmax, layer norms, Adam) is a small share of the step.
    assert matmul <= g.total_flops < 1.1 * matmul
    assert 330e6 < g.param_count() < 345e6
    roles = {leaf.role for leaf in g.inputs}
    assert roles == {Role.PARAM, Role.OPT_STATE, Role.BATCH}


def _max_abs_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.slow  # an Equinox step captured and replayed
def test_equinox_step_roles_and_replay():
    eqx = pytest.importorskip("equinox")
    from automap._run import run_graph

    params, static = eqx.partition(eqx.nn.MLP(5, 3, 16, 2, key=jax.random.key(0)), eqx.is_array)
    tx = optax.adam(1e-3)

    def step(model, opt_state, x, y):
        def loss(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    args = (params, tx.init(params), jnp.ones((8, 5)), jnp.ones((8, 3)))
    g = capture(step, *args)
    roles = {leaf.path: leaf.role for leaf in g.inputs}
    assert roles["[0].layers[0].weight"] is Role.PARAM
    assert roles["[1][0].mu.layers[0].weight"] is Role.OPT_STATE
    assert roles["[2]"] is Role.BATCH and roles["[3]"] is Role.BATCH
    replay = jax.jit(lambda *a: run_graph(g, *a))(*args)
    assert _max_abs_diff(replay, jax.jit(step)(*args)) <= 1e-6


@pytest.mark.slow  # a Keras step captured and replayed
def test_keras_stateless_step_roles_and_replay():
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras was imported with another backend")
    from automap._run import run_graph

    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    mse = keras.losses.MeanSquaredError()

    def step(trainable_variables, non_trainable_variables, optimizer_variables, x, y):
        def loss(tv, ntv):
            pred, ntv = model.stateless_call(tv, ntv, x, training=True)
            return mse(y, pred), ntv

        (value, ntv), grads = jax.value_and_grad(loss, has_aux=True)(
            trainable_variables, non_trainable_variables
        )
        tv, ov = opt.stateless_apply(optimizer_variables, grads, trainable_variables)
        return value, tv, ntv, ov

    values = lambda vs: [v.value for v in vs]  # noqa: E731
    args = (values(model.trainable_variables), values(model.non_trainable_variables))
    args = (*args, values(opt.variables), jnp.ones((8, 5)), jnp.ones((8, 3)))
    g = capture(step, *args)
    by_arg = {i: {leaf.role for leaf in g.inputs if leaf.arg_index == i} for i in range(5)}
    assert by_arg == {
        0: {Role.PARAM},
        1: {Role.OTHER},
        2: {Role.OPT_STATE},
        3: {Role.BATCH},
        4: {Role.BATCH},
    }
    replay = jax.jit(lambda *a: run_graph(g, *a))(*args)
    assert _max_abs_diff(replay, jax.jit(step)(*args)) <= 1e-6


@pytest.mark.slow
def test_gpt_6_7b_captures_abstractly_in_little_memory():
    # In a fresh process, so the figure is capture's own peak and not the test session's.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        from automap._capture import capture
        from automap._zoo import get_model
        spec = get_model("gpt-6.7b")
        graph = capture(spec.step_fn, *spec.abstract_args())
        assert graph.param_count() > 6.5e9
        # VmHWM, not ru_maxrss: ru_maxrss survives exec and can report the forked
        # pytest parent's size; VmHWM belongs to this program's own address space.
        hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")]
        print(hwm[0].split()[1])  # KiB
        """
    )
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    peak_gib = int(out.stdout.split()[-1]) / 2**20
    assert peak_gib < 1.0, f"peak RSS {peak_gib:.2f} GiB"


def test_capture_records_which_leaves_a_jitted_step_donates():
    # A step jitted with donate_argnums (or argnames) hands XLA those leaves to write its
    # outputs over; the graph says which, and the program (its fingerprint) is the same.
    def step(params, opt, batch):
        g = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
        return {"w": params["w"] - 0.1 * g["w"]}, opt + 1.0, jnp.sum(batch)

    args = ({"w": jnp.ones((4, 4))}, jnp.zeros((4, 4)), jnp.ones((2, 4)))
    plain = capture(step, *args)
    assert [leaf.donated for leaf in plain.inputs] == [False, False, False]
    assert not any(leaf.donated for leaf in capture(jax.jit(step), *args).inputs)
    both = capture(jax.jit(step, donate_argnums=(0, 1)), *args)
    assert [leaf.donated for leaf in both.inputs] == [True, True, False]
    named = capture(jax.jit(step, donate_argnames=("params",)), *args)
    assert [leaf.donated for leaf in named.inputs] == [True, False, False]
    assert plain.fingerprint == both.fingerprint == named.fingerprint
