"""The numerics check (`automap._verify.compare_outputs`): correct plans pass whatever the
CPU's rounding, broken plans fail.

No test here asserts a rounding outcome: correct plans must pass (on AVX-512 and on
XLA_FLAGS=--xla_cpu_max_isa=AVX2 kernels alike), and every mistake is either injected
into the runtime or built as the outputs it produces, far outside any rounding."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import automap as am
from automap._verify import compare_outputs, margins, reordered
from automap._zoo import get_model

CPU8 = am.Cluster.preset("cpu", devices=8)
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 8, "vocab": 512}


@functools.cache
def _zoo(model: str, dtype: str):
    """A zoo step (small variants of the transformers), its arguments and expert plans."""
    spec = get_model(model, dtype=dtype, **({} if model == "mlp" else SMALL))
    args = spec.concrete_args(0)
    return spec.step_fn, args, am.expert_plans(spec.step_fn, *args, cluster=CPU8)


def _verified(fn, plan, args):
    report = am.verify(fn, plan, *args)
    assert report.numerics_ok is True, f"{plan.name}: {report.summary()}"


def _check(fn, args, got, noise=None):
    want = jax.jit(fn)(*args)
    return compare_outputs(got, want, graph=am.capture(fn, *args), before=args, noise=noise)


# -- correct plans pass ------------------------------------------------------------------

QUICK = [
    ("mlp", "float32", "megatron"),  # a user's AVX2 CPU: Adam's +-lr flips in a kernel
    ("mlp", "float32", "megatron_dp"),
    ("mlp", "bfloat16", "data_parallel"),  # bf16 compute, float32 master weights
    ("mlp", "bfloat16", "gpipe_uniform"),  # a pipeline: microbatches summed per stage
    ("bert-base", "float32", "data_parallel"),  # attention key biases: true gradient 0
    ("gpt2-xl", "bfloat16", "megatron"),
    ("gpt2-xl", "bfloat16", "zero2"),  # float32 masters on shards, bf16 casts gathered
]


@pytest.mark.parametrize(("model", "dtype", "name"), QUICK, ids=["-".join(q) for q in QUICK])
def test_expert_plans_pass_verify(model, dtype, name):
    fn, args, plans = _zoo(model, dtype)
    _verified(fn, plans[name], args)


@pytest.mark.slow  # every expert plan of three models at two dtypes: minutes on two cores
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["mlp", "bert-base", "gpt2-xl"])
def test_every_expert_plan_passes_verify(model, dtype):
    # The QUICK plans run in every tier (test_expert_plans_pass_verify, above): verifying
    # them here again would compile and run the same programs twice.
    fn, args, plans = _zoo(model, dtype)
    assert {name for m, d, name in QUICK if (m, d) == (model, dtype)} <= set(plans)
    for name, plan in plans.items():
        if (model, dtype, name) not in QUICK:
            _verified(fn, plan, args)


class _Classifier(nn.Module):
    """A Flax MLP with layer norm and zero-initialized biases."""

    @nn.compact
    def __call__(self, x):
        for width in (64, 64, 32):
            x = nn.LayerNorm()(nn.gelu(nn.Dense(width)(x)))
        return nn.Dense(8)(x)


def _flax_step(optimizer):
    """Flax's idiom: (params, opt_state, batch) -> (loss, params, opt_state)."""
    model = _Classifier()
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = model.init(k1, jnp.zeros((1, 32)))["params"]
    batch = {"x": jax.random.normal(k2, (64, 32)), "y": jax.random.randint(k3, (64,), 0, 8)}

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step, (params, optimizer.init(params), batch)


OPTIMIZERS = {"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_flax_step_passes_under_adam_and_sgd(optimizer):
    fn, args = _flax_step(OPTIMIZERS[optimizer])
    plans = am.expert_plans(fn, *args, cluster=CPU8)
    pipelines = [name for name, plan in plans.items() if plan.pipelined]
    assert pipelines, sorted(plans)
    for name in ("data_parallel", "megatron_dp", pipelines[0]):
        _verified(fn, plans[name], args)


def test_a_keras_step_passes():
    from examples.keras_mlp import make_step

    fn, args = make_step()
    plans = am.expert_plans(fn, *args, cluster=CPU8)
    for name in ("data_parallel", "megatron"):
        _verified(fn, plans[name], args)


def test_the_unsharded_step_with_its_batch_reversed_passes_without_a_reordered_run():
    # The same mathematics summed in another order: the structural tolerances alone
    # (no reordered run to widen them) accept it.
    fn, args, _ = _zoo("gpt2-xl", "float32")
    params, opt_state, batch = args
    flipped = jax.tree_util.tree_map(lambda x: x[::-1], batch)
    verdict = _check(fn, args, jax.jit(fn)(params, opt_state, flipped))
    assert verdict.equal, verdict


# -- the rules, on outputs built to test them ---------------------------------------------


def _mlp_step(optimizer, grad_scale=1.0):
    """A small MLP with zero-initialized biases; `grad_scale` != 1 is a bug (a sum over
    shards where a mean was meant)."""

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = jax.tree_util.tree_map(lambda g: g * grad_scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.1,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 8)) * 0.1,
        "b2": jnp.zeros(8),
    }
    batch = {"x": jax.random.normal(k3, (64, 16)), "y": jax.random.normal(k4, (64, 8))}
    return step, (params, optimizer.init(params), batch)


def _edit(outputs, path_part, edit):
    """`outputs` with `edit(old_value)` applied to the first leaf whose path has `path_part`."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(outputs)
    k = next(i for i, (p, _) in enumerate(leaves) if path_part in jax.tree_util.keystr(p))
    values = [x for _, x in leaves]
    values[k] = edit(values[k])
    return jax.tree_util.tree_unflatten(tree, values), jax.tree_util.keystr(leaves[k][0])


@pytest.mark.parametrize(("optimizer", "flips"), [("adam", True), ("sgd", False)])
def test_a_flipped_update_passes_only_with_per_parameter_state(optimizer, flips):
    # Adam's update of a rounding-sized gradient is +-lr either way; SGD's is lr x the
    # gradient, so a flipped SGD update is a wrong gradient.
    step, args = _mlp_step(OPTIMIZERS[optimizer])
    want = jax.jit(step)(*args)
    old = args[0]["w2"]
    got, _ = _edit(want, "[1]['w2']", lambda new: new.at[0, 0].set(2 * old[0, 0] - new[0, 0]))
    verdict = _check(step, args, got)
    assert verdict.equal is flips, verdict
    # Either way an update may not grow: five times the update is a wrong step.
    grown, path = _edit(want, "[1]['w2']", lambda new: new.at[0, 0].add(5 * (new - old)[0, 0]))
    error = 5 * float(abs(want[1]["w2"] - old)[0, 0])
    assert _check(step, args, grown) == (False, pytest.approx(error, rel=1e-3), path)


def test_optimizer_state_is_held_tightly_and_reported_with_its_own_error():
    # The new `nu` pairs with the old `nu` by path, but its role is optimizer state: a
    # tenth of its family's scale is a real difference, not a flipped update. A flipped
    # parameter update (allowed, and a larger error) must not lend the report its error.
    step, args = _mlp_step(optax.adam(1e-3))
    want = jax.jit(step)(*args)
    old = args[0]["w2"]
    got, _ = _edit(want, "[1]['w2']", lambda new: new.at[0, 0].set(2 * old[0, 0] - new[0, 0]))
    shift = 0.1 * float(want[2][0].nu["b1"].max())
    got, path = _edit(got, ".nu['b1']", lambda nu: nu.at[0].add(shift))
    assert _check(step, args, got) == (False, pytest.approx(shift, rel=1e-3), path)


@pytest.mark.parametrize(
    ("optimizer", "shows_in"), [("adam", ".mu["), ("sgd", "[1][")], ids=["adam", "sgd"]
)
def test_a_wrong_gradient_scale_fails(optimizer, shows_in):
    step, args = _mlp_step(OPTIMIZERS[optimizer])
    buggy, _ = _mlp_step(OPTIMIZERS[optimizer], grad_scale=2.0)
    verdict = _check(step, args, jax.jit(buggy)(*args))
    # Adam normalizes the update: the doubled gradient shows in its first moment. SGD's
    # update is the gradient: the parameters show it.
    assert not verdict.equal and shows_in in verdict.leaf, verdict


def test_nan_inf_complex_and_integers():
    fn = lambda x: (x, x * 1j, (x > 0).astype(jnp.int32))  # noqa: E731
    x = jnp.array([1.0, jnp.nan, jnp.inf, -2.0])
    graph, want = am.capture(fn, x), jax.jit(fn)(x)
    assert compare_outputs(want, want, graph=graph, before=(x,)) == (True, 0.0, "[0]")
    number = (x.at[1].set(0.0), *want[1:])
    assert compare_outputs(number, want, graph=graph, before=(x,)) == (False, np.inf, "[0]")
    assert not compare_outputs(want, number, graph=graph, before=(x,)).equal
    imaginary = (want[0], want[1] + 1e-3j, want[2])
    assert compare_outputs(imaginary, want, graph=graph, before=(x,))[::2] == (False, "[1]")
    off_by_one = (*want[:2], want[2] + 1)
    assert compare_outputs(off_by_one, want, graph=graph, before=(x,)) == (False, 1.0, "[2]")


# -- broken plans fail -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def mlp(request):
    fn, args, plans = _zoo("mlp", request.param)
    return fn, args, plans, reordered(fn, args, jax.devices())


def test_a_dropped_gradient_all_reduce_fails(mlp):
    # Built: data parallelism without the gradient reduction leaves every device the
    # parameters and optimizer state of its own share of the batch (device 0's here).
    fn, args, plans, noise = mlp
    params, opt_state, batch = args
    share = jax.tree_util.tree_map(lambda x: x[: len(x) // plans["data_parallel"].devices], batch)
    verdict = _check(fn, args, jax.jit(fn)(params, opt_state, share), noise)
    assert not verdict.equal, verdict


def test_swapped_shards_of_a_parameter_fail(mlp):
    # Built: megatron's outputs with the two halves of one sharded kernel swapped.
    fn, args, plans, noise = mlp
    got = am.apply(fn, plans["megatron"])(*args)
    assert _check(fn, args, got, noise).equal
    swapped, path = _edit(got, "['layer_1']['kernel']", lambda w: jnp.roll(w, w.shape[1] // 2, 1))
    verdict = _check(fn, args, swapped, noise)
    assert not verdict.equal and verdict.leaf == path, verdict


def _pipeline_with(monkeypatch, name, fault):
    """Patch the pipeline's gradient accumulation's `name` with `fault(original)`."""
    import automap._run._accumulate as accumulation

    monkeypatch.setattr(accumulation, name, fault(getattr(accumulation, name)))


FAULTS = {
    # Injected: a stage's once-per-step reduction of its partial sums ([d, ...] over the
    # data axis) keeps device 0's share, or sums twice (x the data-axis size).
    "dropped all-reduce": ("total", lambda total: lambda partials: partials[0]),
    "reduced twice": ("total", lambda total: lambda p: total(p) * p.shape[0]),
    # Injected: the running sums of a stage's accumulated gradients are not added, so the
    # earlier of the two microbatches is lost.
    "lost microbatch": (
        "adding",
        lambda adding: lambda body, outputs, sums: lambda *v: tuple(body(*v[: len(v) - len(sums)])),
    ),
}


def _two_microbatches(plans):
    """The pipeline every fault is injected into: two microbatches, so that the running
    sums add one into the other."""
    return dataclasses.replace(plans["gpipe_uniform"], microbatches=2)


def test_the_pipeline_the_faults_break_passes_unbroken(mlp):
    # Once per dtype, not once per fault: each fault test's failure is then the fault's.
    fn, args, plans, noise = mlp
    plan = _two_microbatches(plans)
    assert plan.mesh["data"] > 1
    assert _check(fn, args, am.apply(fn, plan)(*args), noise).equal


@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_pipeline_fails(mlp, monkeypatch, fault):
    fn, args, plans, noise = mlp
    _pipeline_with(monkeypatch, *FAULTS[fault])
    verdict = _check(fn, args, am.apply(fn, _two_microbatches(plans))(*args), noise)
    assert not verdict.equal, verdict


def _flat_list_step():
    """Keras's layout in plain JAX: parameters a list, and Adam's variables one flat list
    `[count, m_0, v_0, m_1, v_1, ...]`. Parameter 1 is an attention key bias: it shifts
    every score of a query alike, so softmax ignores it and its true gradient is 0."""
    b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-7

    def loss_fn(params, x):
        wq, kb, wv = params
        q, k = x @ wq, x @ wq + kb
        attention = jax.nn.softmax(q @ k.T / 4.0, axis=-1)
        return jnp.mean((attention @ (x @ wv)) ** 2)

    def step(params, optimizer_variables, x):
        grads = jax.grad(loss_fn)(params, x)
        state = optimizer_variables
        count = state[0] + 1
        new_params, new_state = [], [count]
        for p, g, m, v in zip(params, grads, state[1::2], state[2::2], strict=True):
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            new_state += [m, v]
            new_params.append(
                p - lr * (m / (1 - b1**count)) / (jnp.sqrt(v / (1 - b2**count)) + eps)
            )
        return new_params, new_state

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [jax.random.normal(k1, (16, 16)), jnp.full((16,), 0.5), jax.random.normal(k2, (16, 8))]
    state = [jnp.zeros((), jnp.float32)]
    for p in params:
        state += [jnp.zeros_like(p), jnp.zeros_like(p)]
    return step, (params, state, jax.random.normal(k3, (32, 16)))


def test_a_moment_whose_true_value_is_zero_in_a_flat_list_is_held_to_its_family():
    # Keras's optimizer variables share no path with their parameters: the key bias's
    # second moment (squares of a gradient that is only rounding) was its own family, held
    # to its own ~1e-16, and a plan's other summation order was called DIFFERENT. Held to
    # all second moments, rounding of its size passes; a real error in a moment still fails.
    step, args = _flat_list_step()
    want = jax.jit(step)(*args)
    v_bias = want[1][4]
    assert float(jnp.max(v_bias)) < 1e-9 * float(jnp.max(want[1][2]))  # only rounding
    other_order = (want[0], [*want[1][:4], v_bias * 3 + 1e-20, *want[1][5:]])
    assert _check(step, args, other_order).equal
    wrong = (want[0], [*want[1][:2], want[1][2] * 1.01, *want[1][3:]])
    error = pytest.approx(0.01 * float(jnp.max(want[1][2])), rel=1e-3)
    assert _check(step, args, wrong) == (False, error, "[1][2]")


def test_margins_say_how_close_each_leaf_came():
    step, args = _flat_list_step()
    want = jax.jit(step)(*args)
    graph = am.capture(step, *args)
    same = margins(want, want, graph=graph, before=args)
    assert same and all(err == 0 and tol > 0 for err, tol in same.values())
    wrong = (want[0], [*want[1][:2], want[1][2] * 1.01, *want[1][3:]])
    err, tol = margins(wrong, want, graph=graph, before=args)["[1][2]"]
    assert err > tol and not compare_outputs(wrong, want, graph=graph, before=args).equal
