"""The layout in memory of a donating step's state: laid out as XLA chooses
(`Layout.AUTO`), so that XLA's TPU updates Adam's state in its gradients' layout without
copying it there and back (DESIGN.md, "Layouts of the state")."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental.layout import Format, Layout

import automap as am
from automap import Plan
from automap._run import apply, input_formats, placed
from automap._verify import compile_plan, verify
from automap._zoo import get_model

OPT = optax.adam(1e-2)


def scaled_step(params, opt_state, batch, scale):
    """An MLP's Adam step whose bfloat16 loss is scaled by a Python float: traced weakly
    typed, the float leaves it bfloat16."""

    def loss_fn(p):
        h = jax.nn.relu(batch["x"] @ p["w1"])
        return scale * jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def scaled_args():
    k = iter(jax.random.split(jax.random.key(0), 4))
    params = {
        "w1": (jax.random.normal(next(k), (32, 64)) / 6).astype(jnp.bfloat16),
        "w2": (jax.random.normal(next(k), (64, 16)) / 8).astype(jnp.bfloat16),
    }
    batch = {
        "x": jax.random.normal(next(k), (16, 32)).astype(jnp.bfloat16),
        "y": jax.random.normal(next(k), (16, 16)).astype(jnp.bfloat16),
    }
    return params, OPT.init(params), batch


def test_a_donating_loop_runs_its_state_as_compiled_and_computes_the_unsharded_loop(monkeypatch):
    # Three steps of a step jitted with its state donated, under a data x model plan: the
    # state is laid out as the compiled program takes it, the loop feeds it back without
    # placing it again (only each new batch moves), and the numbers are the unsharded
    # loop's, in its dtypes (the Python float stays weakly typed in the compiled step).
    params, opt, batch = scaled_args()
    rules = {"['w1']": (None, "model"), "['w2']": ("model", None), "['x']": ("data", None)}
    specs = {}
    for path, x in jax.tree_util.tree_flatten_with_path((params, opt, batch, 0.5))[0]:
        key = jax.tree_util.keystr(path)
        hit = [s for name, s in rules.items() if key.endswith(name)]
        specs[key] = hit[0] if hit else (None,) * np.ndim(x)
    plan = Plan(mesh={"data": 2, "model": 4}, specs=specs)
    donating = jax.jit(scaled_step, donate_argnums=(0, 1))
    want = (None, params, opt)
    for _ in range(3):
        want = jax.jit(scaled_step)(*want[1:], batch, 0.5)
    step = apply(donating, plan)
    state = jax.tree.map(jnp.copy, (params, opt))  # the originals are donated
    state = step(*state, batch, 0.5)[1:]
    put = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **k: put.append(x) or real(x, s, **k))
    for _ in range(2):
        host = jax.tree.map(np.asarray, batch)  # a fresh host batch, as a data loader gives
        loss, *state = step(*state, host, 0.5)
    assert [len(x) for x in put] == [len(jax.tree.leaves(batch)) + 1] * 2  # the batch, the float
    formats = input_formats(step.prepare(*state, batch, 0.5).executable)
    assert all(x.format == f for x, f in zip(jax.tree.leaves(state), formats, strict=False))
    for got, expected in zip(jax.tree.leaves((loss, state)), jax.tree.leaves(want), strict=True):
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-3
        )


def noisy_step(params, key, x):
    k1, k2 = jax.random.split(key)
    noisy = x + jax.random.normal(k1, x.shape)
    grads = jax.grad(lambda p: jnp.mean(noisy @ p["w"]))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), k2


def test_a_donated_typed_key_stays_laid_as_jax_lays_it_beside_the_state():
    # A typed PRNG key is laid out as its key data, of another rank: donated beside the
    # parameters it keeps its own layout (its pair with the key it becomes too, as JAX
    # asks of a donated pair) while the parameters are laid as XLA chooses.
    params = {"w": jax.random.normal(jax.random.key(1), (16, 4))}
    x = jnp.ones((8, 16))
    plan = Plan(
        mesh={"data": 2}, specs={"[0]['w']": (None, None), "[1]": (), "[2]": ("data", None)}
    )
    step = apply(jax.jit(noisy_step, donate_argnums=(0, 1)), plan)
    got = step(*step(jax.tree.map(jnp.copy, params), jax.random.key(0), x), x)
    want = jax.jit(noisy_step)(*jax.jit(noisy_step)(params, jax.random.key(0), x), x)
    np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(want[0]["w"]), rtol=1e-6)
    assert (jax.random.key_data(got[1]) == jax.random.key_data(want[1])).all()
    assert step.prepare(*got, x).laid_by_xla == (0,)


def test_a_donated_array_laid_out_anew_is_given_up_to_its_copy():
    # The first call of a donating step lays its state out as compiled: a donated array
    # only laid out otherwise (its sharding kept) is freed as it is copied, so that a chip
    # that holds the state once need not hold it twice; one not donated is kept.
    x, y = jnp.ones((8, 16)), jnp.ones((8, 16))
    column = Format(Layout(major_to_minor=(1, 0)), x.sharding)
    moved = placed([x, y], [column, column], donated=(0,))
    assert all(m.format.layout.major_to_minor == (1, 0) for m in moved)
    assert x.is_deleted() and not y.is_deleted()
    np.testing.assert_array_equal(np.asarray(moved[0]), np.ones((8, 16)))


@pytest.mark.tpu_compile
@pytest.mark.slow  # compiled for 4 v5p chips, twice: ~10 s on two loaded cores
def test_a_tpu_updates_adams_state_in_its_gradients_layout_without_copying_it():
    # A bf16 2-layer Llama at data 4 on v5p 2x2x1 under full recomputation. The gradients
    # of 15 of its 16 matrices come out of their dots transposed ({0,1}). With the state
    # in the row-major layout XLA's TPU copied each such parameter and both of its Adam
    # moments into that layout to update them (41 float32 copies into {0,1}): unpriced
    # temporaries, the plan priced at 0.74 of XLA's buffers. Laid out as XLA chooses, the
    # state is updated where it lies (6 such copies left) and priced at 0.90. XLA's first
    # choice gives one moment back laid otherwise than it takes it; compiled again with it
    # pinned, the state goes out laid as it came in, so a loop feeds it back untouched.
    sizes = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, seq=256, batch=8)
    spec = get_model("llama", **sizes, vocab=256, dtype="bfloat16")
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=4, remat="full"), cluster=v5p)
    compiled = compile_plan(step, plan, args, target="v5p:2x2x1")
    text = compiled[1].as_text()
    transposed = re.findall(r"= f32\[\d+,\d+\]\{0,1[^}]*\} copy\(", text)
    matrices = [x for x in jax.tree.leaves(args[0]) if x.ndim == 2]
    assert len(matrices) == 16
    assert len(transposed) < len(matrices)
    state = len(jax.tree.leaves(args[:2]))  # the step returns (loss, params, Adam's state)
    ins = [f.layout for f in input_formats(compiled[1])[:state]]
    assert [f.layout for f in jax.tree.leaves(compiled[1].output_formats)[1:]] == ins
    assert any(lay.major_to_minor == (1, 0) for lay in ins)  # some matrices column-major
    report = verify(step, plan, *args, target="v5p:2x2x1", compiled=compiled)
    assert report.predicted_memory_bytes / report.xla_memory_bytes > 0.85
