"""Bad input, in one table: each row is a one-line error that names the problem and the
fix, or (where the input is fine after all) the right result. Issue 14, section 5."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

import automap as am
from _child import child_env
from automap._cli import app
from automap._zoo import get_model

CPU8 = am.Cluster.preset("cpu", devices=8)
runner = CliRunner()
MLP_PLAN = ("plan", "--model", "mlp", "--set", "dtype=float32", "--cluster", "cpu")


def _mlp():
    spec = get_model("mlp", batch=16, dtype="float32")
    return spec.step_fn, spec.concrete_args(0)


def _api_error(call: Callable[[], object]) -> str:
    """The message of the AutomapError `call` raises (the test fails when it raises none)."""
    with pytest.raises(am.AutomapError) as info:
        call()
    return str(info.value)


def _cli_error(*args: str) -> str:
    """The one error line a command prints on stderr, exit code 2, nothing on stdout."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    return result.stderr


def _cli_ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _cluster_file(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"preset: a100\n{line}\n")
    return path


def _cluster_error(line: str) -> Callable[[Path], str]:
    return lambda tmp: _api_error(lambda: am.Cluster.from_file(_cluster_file(tmp, line)))


def _numeric_string_is_a_number(tmp: Path) -> str:
    cluster = am.Cluster.from_file(_cluster_file(tmp, "peak_flops: 312e12"))
    assert cluster.peak_flops == 312e12  # PyYAML reads 312e12 as a string
    return f"peak {cluster.peak_flops:g}"


def _plan_with(**kwargs) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        step_fn, args = _mlp()
        options = {"cluster": CPU8, "searcher": "expert"} | kwargs
        return _api_error(lambda: am.plan(step_fn, *args, **options))

    return run


def _apply_with(plan: object) -> Callable[[Path], str]:
    return lambda tmp: _api_error(lambda: am.apply(_mlp()[0], plan))


def _no_argument_step(tmp: Path) -> str:
    w = jnp.ones((8, 8))
    return _api_error(lambda: am.plan(lambda: jnp.sum(w @ w), cluster=CPU8, searcher="ilp"))


def _before_search(*args: str) -> Callable[[Path], str]:
    """The command's error, found before any capture or search (which would fail here)."""

    def run(tmp: Path) -> str:
        def no_search(*_, **__):
            raise AssertionError("the command searched before refusing its output path")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("automap._api.Problem.build", no_search)
            return _cli_error(*(a.replace("TMP", str(tmp)) for a in args))

    return run


def _unwritable(tmp: Path) -> str:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: no unwritable directory to test with")
    locked = tmp / "locked"
    locked.mkdir(mode=0o500)
    return _before_search(*MLP_PLAN, "-o", "TMP/locked/plan.json")(tmp)


def _no_file_left(check: Callable[[Path], str], path: str) -> Callable[[Path], str]:
    """`check`'s text, after making sure the writability probe left no file at `path`."""

    def run(tmp: Path) -> str:
        text = check(tmp)
        assert not Path(path.replace("TMP", str(tmp))).exists()
        return text

    return run


def _before_calibrating(*args: str) -> Callable[[Path], str]:
    """calibrate's error about its output, found before it measures anything."""

    def run(tmp: Path) -> str:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("automap._bench.measure", lambda **_: pytest.fail("measured"))
            return _cli_error("calibrate", *(a.replace("TMP", str(tmp)) for a in args))

    return run


def _a_plan_file(tmp: Path) -> Path:
    path = tmp / "plan.json"
    step_fn, args = _mlp()
    am.plan(step_fn, *args, cluster=CPU8, searcher="expert").save(path)
    return path


def _edited_plan(command: str, edit: Callable[[dict], None]) -> Callable[[Path], str]:
    """`automap apply --check` or `report` on a saved plan edited by hand (issue 28)."""

    def run(tmp: Path) -> str:
        path = _a_plan_file(tmp)
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
        args = ("apply", str(path), "--check") if command == "apply" else ("report", str(path))
        return _cli_error(*args)

    return run


def _report_to_a_full_disk(tmp: Path) -> str:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to stand in for a full disk")
    return _cli_error("report", str(_a_plan_file(tmp)), "-o", "/dev/full")


def _report_to(target: str) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        plan = _a_plan_file(tmp)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("automap._report.write_report", lambda *a, **k: pytest.fail("drew"))
            return _cli_error("report", str(plan), "-o", target.replace("TMP", str(tmp)))

    return run


def _quiet_answer(tmp: Path) -> str:
    return _cli_ok(*MLP_PLAN, "--searcher", "expert", "-q")


def _fn_module(tmp: Path, body: str) -> str:
    (tmp / "user_step_bad.py").write_text(body)
    sys.modules.pop("user_step_bad", None)
    return "user_step_bad:make_step"


def _fn_args_dict(tmp: Path) -> str:
    body = (
        "import jax.numpy as jnp\n"
        "def make_step():\n"
        "    return (lambda w, x: jnp.sum(x @ w)), {'w': jnp.ones((4, 4)), 'x': jnp.ones((8, 4))}\n"
    )
    return _cli_error("plan", "--fn", _fn_module(tmp, body), "--cluster", "cpu")


def _keyed_step(params, batch):
    """A step whose batch carries a raw PRNG key for its noise, and returns its loss."""

    def loss(p):
        x = batch["x"] + 0.01 * jax.random.normal(batch["key"], batch["x"].shape)
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads), value


def _keyed_args(batch: int):
    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 4))}
    data = {"x": jnp.ones((batch, 16)), "y": jnp.ones((batch, 4)), "key": jax.random.PRNGKey(0)}
    return params, data


def _key_is_not_the_batch(tmp: Path) -> str:
    from automap._search import Problem

    problem = Problem.build(_keyed_step, _keyed_args(16), CPU8)
    roles = {leaf.path: leaf.role.value for leaf in problem.graph.inputs}
    plans = am.expert_plans(_keyed_step, *_keyed_args(16), cluster=CPU8)
    key = roles["[1]['key']"]
    return f"key {key}, batch {problem.groups.batch_size}, {sorted(plans)}"


def _indivisible_batch_compare(batch: int) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        from automap._bench import compare

        rows = compare(
            _keyed_step,
            *_keyed_args(batch),
            cluster=CPU8,
            searchers=["expert", "random"],
            budget_s=0.2,
        )
        return ", ".join(f"{r.searcher}:{r.plan_name}:{r.feasible}" for r in rows)

    return run


def _plan_for_another_model(tmp: Path) -> str:
    step_fn, args = _mlp()
    plan = am.plan(step_fn, *args, cluster=CPU8, searcher="expert")
    other = get_model("mlp", layers=6, batch=16, dtype="float32")
    text = _api_error(lambda: am.apply(other.step_fn, plan)(*other.concrete_args(0)))
    assert len(text) < 600, text  # the first few paths, not every one
    return text


def _plan_for_another_batch(check: str) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        plan = am.plan(_keyed_step, *_keyed_args(16), cluster=CPU8, searcher="expert")
        if check == "apply":
            return _api_error(lambda: am.apply(_keyed_step, plan)(*_keyed_args(6)))
        return _api_error(lambda: am.verify(_keyed_step, plan, *_keyed_args(6)))

    return run


def _replicated_plan(tmp: Path) -> str:
    from automap._bench import make_row
    from automap._report import answer_line

    step_fn, args = _mlp()
    specs = {
        p: (None,) * len(s)
        for p, s in am.expert_plans(step_fn, *args, cluster=CPU8)["data_parallel"].specs.items()
    }
    plan = am.Plan(mesh={"data": 8}, specs=specs, name="nothing")
    return f"{answer_line(plan)} | {make_row('x', plan, 0.0).shape}"


def _donation_kept(tmp: Path) -> str:
    """The compiled program of a step jitted with donate_argnums aliases its inputs."""
    step_fn, args = _mlp()
    plan = am.plan(step_fn, *args, cluster=CPU8, searcher="expert")
    texts = []
    for fn in (step_fn, jax.jit(step_fn, donate_argnums=(0, 1))):
        prepared = am.apply(fn, plan).prepare(*args)
        compiled = prepared.compile(args).as_text()
        texts.append("aliased" if "input_output_alias=" in compiled else "copied")
    return " then ".join(texts)


def _compare_off_a_terminal(tmp: Path) -> str:
    out = _cli_ok(
        "compare", "--model", "mlp", "--cluster", "cpu", "--searchers", "expert", "--budget", "1"
    )
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert all(line.count("│") == 10 and "…" not in line for line in rows), out
    return "\n".join(rows)


def _progress_off_a_terminal(searcher: str = "random") -> Callable[[Path], str]:
    """The progress lines `automap plan` writes on stderr off a terminal (one per step:
    LOG_EVERY_S is 0 here): every searcher writes them, auto and dp included (issue 28)."""

    def run(tmp: Path) -> str:
        from automap._search import SearchProgress

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SearchProgress, "LOG_EVERY_S", 0.0)
            args = [*MLP_PLAN, "--set", "layers=2", "--searcher", searcher, "--budget"]
            result = runner.invoke(app, [*args, "0.1" if searcher == "random" else "2"])
        assert result.exit_code == 0 and "step time" in result.stdout, result.output
        return result.stderr

    return run


def _devices_chosen(tmp: Path) -> str:
    from types import SimpleNamespace

    from automap._cli import choose_devices

    gpus = [SimpleNamespace(platform="gpu")] * 8
    cpus = [SimpleNamespace(platform="cpu")] * 8
    picks = [choose_devices(gpus[:k], lambda: cpus, 8) for k in (8, 1)]
    picks.append(choose_devices(cpus, lambda: pytest.fail("asked the CPU twice"), 8))
    return " | ".join(f"{d[0].platform}×{len(d)} {note}" for d, note in picks)


def _apply_says_where_it_ran(tmp: Path) -> str:
    path = str(tmp / "zoo.json")
    _cli_ok(*MLP_PLAN, "--searcher", "expert", "-q", "-o", path)
    return _cli_ok("apply", path, "--json")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Path], str]  # the message (error) or output (right result) to check
    match: str  # a regular expression the text must contain
    error: bool = True  # an error must be one line


CASES = [
    # 1. Cluster files: the field, the type and the allowed range.
    Case("hbm_80GB", _cluster_error('hbm_bytes: "80GB"'), r"hbm_bytes must be a number \(bytes\) > 0, got '80GB'"),
    Case("peak_numeric_string", _numeric_string_is_a_number, r"peak 3\.12e\+14", error=False),
    Case("per_node_0", _cluster_error("devices_per_node: 0"), r"devices_per_node must be an integer >= 1, got 0"),
    Case("intra_bw_0", _cluster_error("intra_bandwidth: 0"), r"intra_bandwidth must be a number \(bytes/s\) > 0"),
    Case("peak_negative", _cluster_error("peak_flops: -1.0e+12"), r"peak_flops must be a number \(FLOP/s\) > 0, got -1e\+12"),
    Case("efficiency_1.5", _cluster_error("comm_efficiency: 1.5"), r"comm_efficiency must be a number > 0 and <= 1"),
    Case("per_node_half", _cluster_error("devices_per_node: 2.5"), r"devices_per_node must be an integer"),
    Case("reduce_scatter_word", _cluster_error("reduce_scatter: maybe"), r"reduce_scatter must be true or false"),
    Case("lowering_unknown", _cluster_error("lowering: npu"), r"cluster\.yaml: unknown lowering 'npu'; choose one of gpu, hopper, tpu, cpu"),
    Case("lowering_field_unknown", _cluster_error("lowering: {fuses: true}"), r"unknown lowering field\(s\) \['fuses'\]"),
    Case("lowering_word", _cluster_error("lowering: {remakes_residuals: sometimes}"), r"remakes_residuals must be true or false, got 'sometimes'"),
    Case("cli_cluster_file", lambda tmp: _cli_error(*MLP_PLAN[:-2], "--cluster", str(_cluster_file(tmp, "peak_flops: -1"))), r"peak_flops must be"),
    # 4. The Python API.
    Case("cluster_string", _plan_with(cluster="a100"), r"not the string 'a100': use am\.Cluster\.preset\('a100'"),
    Case("cluster_none", _plan_with(cluster=None), r"cluster must be a Cluster, got NoneType"),
    Case("apply_path", _apply_with("plan.json"), r"not the path 'plan\.json': load it first"),
    Case("apply_none", _apply_with(None), r"apply takes a Plan .* got NoneType"),
    Case("load_directory", lambda tmp: _api_error(lambda: am.Plan.load(tmp)), r"is a directory, not a plan file"),
    Case("role_unknown", _plan_with(roles={"params": "weights"}), r"'weights' is not a role; use one of 'param', 'opt_state', 'batch', 'other'"),
    Case("role_key_unknown", _plan_with(roles={"nonexistent": "param"}), r"roles key 'nonexistent' matches no argument .*argument names: 'params'"),
    Case("role_index_unknown", _plan_with(roles={7: "param"}), r"roles key 7 matches no argument"),
    Case("no_argument_step", _no_argument_step, r"takes no array arguments"),
    Case("seed_negative_mcmc", _plan_with(searcher="mcmc", seed=-1, budget_s=0.5), r"seed must be a whole number >= 0 .* got -1 \(e\.g\. seed=0\)"),
    Case("seed_negative_dqn", _plan_with(searcher="dqn", seed=-1, budget_s=0.5), r"seed must be a whole number >= 0"),
    Case("seed_not_whole", _plan_with(searcher="random", seed=1.5, budget_s=0.5), r"seed must be a whole number >= 0 .* got 1\.5"),
    Case("cli_seed_negative", _before_search(*MLP_PLAN, "--searcher", "dqn", "--seed", "-1"), r"--seed must be a whole number >= 0 .* got -1 \(e\.g\. --seed 0\)"),
    Case("compare_seed_negative", _before_search("compare", "--model", "mlp", "--searchers", "mcmc", "--seed", "-1"), r"--seed must be a whole number >= 0"),
    # 9. Plans edited by hand (issue 28): apply and report refuse them in one line.
    Case("apply_mesh_0", _edited_plan("apply", lambda p: p.update(mesh={"data": 0})), r"plan\.json: mesh\['data'\] must be a whole number of devices >= 1, got 0"),
    Case("report_mesh_negative", _edited_plan("report", lambda p: p.update(mesh={"data": -8})), r"mesh\['data'\] must be a whole number of devices >= 1, got -8"),
    Case("report_microbatches_0", _edited_plan("report", lambda p: p.update(microbatches=0)), r"microbatches must be a whole number >= 1, got 0"),
    Case("apply_remat_string", _edited_plan("apply", lambda p: p.update(remat="false")), r"remat must be true or false \(a JSON boolean\), got 'false'"),
    Case("apply_zero_7", _edited_plan("apply", lambda p: p.update(zero_stage=7)), r"zero_stage must be 0, 1, 2 or 3, got 7"),
    Case("apply_another_model", _edited_plan("apply", lambda p: p["provenance"].update(model="bert-large", overrides={})), r"the plan's inputs are not those of bert-large, the step its provenance names .* set provenance\.model and provenance\.overrides to the model the plan was made for"),
    # 2. Output paths, refused before the search.
    Case("plan_o_missing_dir", _before_search(*MLP_PLAN, "-o", "TMP/nowhere/plan.json"), r"the directory .*nowhere does not exist; create it first"),
    Case("plan_o_under_a_file", lambda tmp: (tmp / "f").write_text("x") and _before_search(*MLP_PLAN, "-o", "TMP/f/plan.json")(tmp), r"/f is a file, not a directory"),
    Case("plan_o_directory", _before_search(*MLP_PLAN, "-o", "TMP"), r"-o .* is a directory: give a file name"),
    Case("plan_o_unwritable", _unwritable, r"cannot be written \(Permission denied"),
    Case("plan_o_proc", _no_file_left(_before_search(*MLP_PLAN, "-o", "/proc/automap-plan.json"), "/proc/automap-plan.json"), r"-o /proc/automap-plan\.json cannot be written \(.*\); choose a writable place"),
    Case("plan_o_probe_removed", _no_file_left(_before_search(*MLP_PLAN, "-o", "TMP/p.json", "--set", "layers=0"), "TMP/p.json"), r"layers"),
    Case("calibrate_o_checked", _before_calibrating("-o", "TMP/nowhere/c.yaml"), r"-o .*nowhere/c\.yaml: the directory .* does not exist"),
    Case("plan_save_agent_dir", _before_search(*MLP_PLAN, "--save-agent", "TMP"), r"--save-agent .* is a directory"),
    Case("compare_json_out_missing", _before_search("compare", "--model", "mlp", "--json-out", "TMP/no/rows.json"), r"--json-out .* does not exist"),
    Case("report_o_missing_dir", _report_to("TMP/nowhere/r.html"), r"the directory .*nowhere does not exist"),
    Case("report_o_directory", _report_to("TMP"), r"is a directory: give a file name"),
    Case("report_o_full_disk", _report_to_a_full_disk, r"^error: the report could not be written to /dev/full \(No space left on device\); free some space"),
    # 3. --quiet without -o or --json prints the answer, in one line.
    Case("quiet_prints_the_answer", _quiet_answer, r"^\S+: mesh .*, step .* per device, feasible\n$", error=False),
    # 6. A raw PRNG key is not the batch; a batch the devices do not divide keeps its rows.
    Case("prng_key_in_batch", _key_is_not_the_batch, r"key other, batch 16, \[.*'data_parallel'.*'gpipe_uniform'", error=False),
    Case("batch_6_on_8", _indivisible_batch_compare(6), r"^expert:.*:True, .*random:\w+:True$", error=False),
    Case("batch_7_on_8", _indivisible_batch_compare(7), r"^expert:megatron:True, .*random:\w+:True$", error=False),
    # 7. Replicated plans, donation, compare's table and progress off a terminal.
    Case("replicated_plan", _replicated_plan, r"^nothing: mesh replicated on 8 devices \(nothing split; mesh data=8\), .* \| replicated \(data 8: nothing split\)$", error=False),
    Case("donate_argnums_kept", _donation_kept, r"^copied then aliased$", error=False),
    Case("compare_table_full_width", _compare_off_a_terminal, r"│ expert +│ gpipe_uniform +│ pipe 2 × data 4, 8 mb 1f1b +│", error=False),
    Case("progress_lines_off_a_terminal", _progress_off_a_terminal(), r"(?m)^random: \d+/20 evaluated, best \d+\.\d+ ms, \d+ s$", error=False),
    Case("progress_lines_ilp", _progress_off_a_terminal("ilp"), r"(?m)^ilp: \d+/\d+ evaluated, best \d+\.\d+ ms, \d+ s$", error=False),
    Case("progress_lines_dp", _progress_off_a_terminal("dp"), r"(?ms)^dp: one stage \(ilp\): \d+/\d+ evaluated, best \d+\.\d+ ms, \d+ s$.*^dp: pipelines: \d+ evaluated, best \d+\.\d+ ms, \d+ s$", error=False),
    Case("progress_lines_auto", _progress_off_a_terminal("auto"), r"(?ms)^auto: one stage \(ilp\): \d+/\d+ evaluated, .*^auto: pipelines: \d+ evaluated, best \d+\.\d+ ms, \d+ s$", error=False),
    # 8. apply uses the accelerators when there are enough of them, else virtual CPUs.
    Case("devices_chosen", _devices_chosen, r"^gpu×8  \| cpu×8 the plan needs 8 devices and this machine has 1 GPU\(s\): running it on 8 virtual CPU devices instead\. \| cpu×8 $", error=False),
    Case("apply_says_where_it_ran", _apply_says_where_it_ran, r'"platform": "cpu"', error=False),
    # 5. --fn returning its args as a dict.
    Case("plan_of_another_model", _plan_for_another_model, r"call lacks: none; inputs of the call the plan lacks: \[0\]\['params'\]\['layer_4'\]\['bias'\], .* and 9 more\. Make the plan"),
    Case("apply_another_batch", _plan_for_another_batch("apply"), r"made for another program: batch size 16, this call's batch is 6\. Make a plan for batch 6"),
    Case("verify_another_batch", _plan_for_another_batch("verify"), r"made for another program: batch size 16, this call's batch is 6\."),
    Case("fn_args_dict", _fn_args_dict, r"args is a tuple of the step's positional arguments \(args is a dict\)"),
]  # fmt: skip


#: Rows that compile or run a model (5-16 s each on the loaded two-core machine): `slow`.
SLOW = {
    "replicated_plan",
    "donate_argnums_kept",
    "apply_says_where_it_ran",
    "plan_of_another_model",
}
assert not SLOW - {c.name for c in CASES}, SLOW - {c.name for c in CASES}  # no typo


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] * (c.name in SLOW)) for c in CASES]
)
def test_bad_input(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = case.run(tmp_path)
    assert re.search(case.match, text), text
    if case.error:
        assert len(text.strip().splitlines()) == 1, text


@pytest.mark.slow  # a planner in a subprocess, stopped at its first progress line (10 s)
def test_sigterm_keeps_the_best_plan_as_ctrl_c_does(tmp_path):
    """A scheduler's time limit (SIGTERM) mid-search saves the best plan so far, exit 143."""
    (tmp_path / "user_step_term.py").write_text(
        "from automap._zoo import get_model\n"
        "def make_step():\n"
        "    spec = get_model('vgg19', batch=16, dtype='float32')\n"
        "    return spec.step_fn, spec.abstract_args()\n"
    )
    out = tmp_path / "best.json"
    command = "from automap._cli import main; main()"
    args = ["plan", "--fn", "user_step_term:make_step", "--cluster", "cpu", "--searcher"]
    args += ["random", "--budget", "3600", "-o", str(out)]
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", command, *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Under way once a progress line (every `SearchProgress.LOG_EVERY_S`, 10 s, off a
        # terminal) shows a feasible best: not after a delay, which a slow capture outlasts
        # (and a fast machine's search of a small space, the mlp's once, ends within); on
        # vgg19's 720,000 points the random search runs for minutes.
        line = proc.stderr.readline()
        while line and not re.match(r"random: [\d/]+ evaluated, best \d", line):
            line = proc.stderr.readline()
        assert line, f"the search ended before it found a plan: {proc.poll()}"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        assert stdout == ""  # the plan table is not printed for a stopped search
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    last = stderr.strip().splitlines()[-1]
    assert last == f"search terminated (SIGTERM): the best plan so far is saved to {out}"
    plan = am.Plan.load(out)
    assert plan.decisions["interrupted"] is True and plan.predicted.feasible


def test_progress_lines_come_while_a_search_advances_nothing(monkeypatch, capsys):
    """Off a terminal a progress line comes every LOG_EVERY_S even while the search
    advances nothing (one long ILP solve, the stage DP between points): lines written
    only on an advance left auto, dp and ilp silent for a whole 25 s search (issue 28)."""
    from automap._search import SearchProgress

    monkeypatch.setattr(SearchProgress, "LOG_EVERY_S", 0.05)
    seen = ""
    with SearchProgress(True, "ilp") as bar:
        bar.start(4)
        deadline = time.monotonic() + 60  # a safety stop only: the line comes long before
        while "ilp: 0/4 evaluated" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().err
    assert re.search(r"(?m)^ilp: 0/4 evaluated, best —, \d+ s$", seen), seen
