"""verify(hbm_bytes=...): a TPU program compiled for a chip with only so much HBM
(`automap._run._hbm`), as XLA compiles a plan that fills the chip."""

import json

import jax
import pytest
from typer.testing import CliRunner

import automap as am
from automap import ApplyError, CompiledOutOfMemoryError
from automap._cli import app
from automap._run import hbm_options, out_of_hbm
from automap._verify import verify
from automap._zoo import get_model
from test_verify import tiny_fn_plan

# libtpu 0.0.42.1's words, as `Lowered.compile` raised them for a program over its limit.
_OOM = (
    "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out "
    "of memory in memory space hbm. Used 58.72M of 53.00M hbm. Exceeded hbm capacity by 5.72M."
)


def test_a_chips_hbm_is_given_to_xla_in_whole_mib_with_its_own_remat_off():
    options = hbm_options(53.5 * 2**20)
    assert options["xla_tpu_max_hbm_size_mib"] == 54  # rounded up: never less than asked
    assert options["xla_tpu_rematerialization_min_size_in_bytes"] >= 2**50
    with pytest.raises(ApplyError, match="give the HBM a chip has"):
        hbm_options(0)


def test_xlas_out_of_hbm_is_one_line_with_what_it_needs():
    short = out_of_hbm(RuntimeError(_OOM), 53 * 2**20)
    assert isinstance(short, CompiledOutOfMemoryError)
    assert short.used_bytes == pytest.approx(58.72 * 2**20)
    assert short.limit_bytes == 53 * 2**20
    assert "cannot fit this plan in 53.0 MiB of HBM a chip: it needs at least 58.7 MiB" in str(
        short
    )
    assert "\n" not in str(short)
    before = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    short = out_of_hbm(
        RuntimeError(before + "temporaries (4.62M) exceeds available HBM (2.00M)."), 2**20
    )
    assert short.used_bytes == pytest.approx(4.62 * 2**20)
    assert out_of_hbm(RuntimeError("INVALID_ARGUMENT: something else"), 53 * 2**20) is None


def test_hbm_bytes_is_refused_off_a_tpu_in_one_line(tmp_path, monkeypatch):
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    w, x = jax.ShapeDtypeStruct((32, 16), "float32"), jax.ShapeDtypeStruct((64, 32), "float32")
    with pytest.raises(ApplyError, match="give a TPU target"):
        verify(lambda w, x: w, plan, w, x, hbm_bytes=2**30)
    with pytest.raises(ApplyError, match="give a TPU target"):
        verify(lambda w, x: w, plan, w, x, target="a100", hbm_bytes=2**30)


@pytest.mark.tpu_compile
@pytest.mark.slow  # compiled twice for 4 v5p chips: ~40 s on two cores
def test_a_tpu_held_to_the_priced_hbm_runs_weight_gradients_with_the_backward():
    # A float32 GPT under ZeRO-1 and full remat on v5p 2x2x1 (data 4, 32 sequences a
    # chip). Given a whole chip, XLA's TPU scheduler runs every weight-gradient matmul
    # inside the update's asynchronous all-gathers, after the whole backward, holding
    # each layer's recomputed activations until then: far over the priced peak. Held to
    # the priced peak + 15% it compiles the same program (its FLOPs, its collectives)
    # within the priced peak's 15%, and below what it takes XLA cannot fit it.
    spec = get_model(
        "gpt2-xl", layers=2, hidden=512, heads=4, seq=128, batch=128, vocab=512, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    recipe = am.Recipe(dp=4, zero=1, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    free = verify(step, plan, *args, target="v5p:2x2x1")
    priced = free.predicted_memory_bytes
    assert free.xla_memory_bytes > 1.3 * priced
    held = verify(step, plan, *args, target="v5p:2x2x1", hbm_bytes=1.15 * priced)
    assert held.xla_memory_bytes == pytest.approx(priced, rel=0.15)
    assert held.xla_flops == pytest.approx(free.xla_flops, rel=1e-3)  # XLA recomputes nothing
    assert held.collectives_match and held.xla_comm_bytes == free.xla_comm_bytes
    assert "compiled as if each chip had" in held.summary()
    with pytest.raises(CompiledOutOfMemoryError, match="cannot fit this plan") as short:
        verify(step, plan, *args, target="v5p:2x2x1", hbm_bytes=0.5 * priced)
    assert short.value.used_bytes > 0.5 * priced


@pytest.mark.tpu_compile
def test_automap_verify_holds_a_tpus_hbm_and_says_when_it_cannot_fit(tmp_path, monkeypatch):
    plan = tiny_fn_plan(tmp_path, monkeypatch)
    step = (tmp_path / "tiny_step.py").read_text()  # its step at MiBs a chip, not KiBs
    step = step.replace("(32, 16)", "(2048, 1024)").replace("(64, 32)", "(256, 2048)")
    (tmp_path / "tiny_step.py").write_text(step)
    path = str(plan.save(tmp_path / "plan.json"))
    verify_on = ["verify", path, "--target", "v5e:4x4", "--json", "--hbm-gib"]
    out = CliRunner().invoke(app, [*verify_on, "1"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert any("1024.0 MiB of HBM" in note for note in report["notes"])
    out = CliRunner().invoke(app, [*verify_on, "0.001"])
    assert out.exit_code != 0
    assert "XLA's TPU compiler cannot fit this plan in 1.0 MiB of HBM a chip" in out.output


@pytest.mark.tpu_compile
@pytest.mark.slow  # a two-stage pipeline compiled three times for 4 v5p chips: ~10 s
def test_a_pipelines_programs_are_compiled_within_the_hbm_their_stage_leaves():
    # GPipe over 2 stages x data 2 on v5p 2x2x1: each stage's programs run beside what
    # the runtime holds on its chips (the other microbatch's activations, the stage's
    # parameters and state when a program does not read them), so each is compiled
    # within the chip's HBM less that. The same programs (FLOPs, collectives), each
    # stage's figure within the chip; below what a stage holds between its programs,
    # nothing fits.
    spec = get_model(
        "gpt2-xl", layers=2, hidden=128, heads=4, seq=64, batch=16, vocab=512, dtype="float32"
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x1")
    recipe = am.Recipe(pp=2, dp=2, microbatches=2, remat="full")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    free = verify(step, plan, *args, target="v5p:2x2x1")
    # Held to XLA's own figure + 15%, not the price's: XLA's reported temporaries count
    # its allocation's excess over the live bytes once more, so at MiBs a chip a program
    # that fits a limit set from the price (0.92x XLA's live peak here) can read over it.
    hbm = 1.15 * max(xla for _, xla in free.stage_memory_bytes)
    held = verify(step, plan, *args, target="v5p:2x2x1", hbm_bytes=hbm)
    assert held.collectives_match and held.xla_comm_bytes == free.xla_comm_bytes
    assert held.stage_flops == free.stage_flops
    assert all(xla <= hbm for _, xla in held.stage_memory_bytes)
    assert "compiled as if each chip had" in held.summary()
    with pytest.raises(CompiledOutOfMemoryError, match=r"cannot fit in .* between its programs"):
        verify(step, plan, *args, target="v5p:2x2x1", hbm_bytes=0.1 * free.predicted_memory_bytes)
