"""The `automap` command line, driven in-process."""

import json
import os

import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._search import SEARCHERS

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_models_lists_the_zoo():
    result = run("models", "--json")
    assert result.exit_code == 0, result.output
    names = {m["name"] for m in json.loads(result.output)}
    assert {"mlp", "bert-base", "bert-large", "gpt-6.7b", "vgg19", "resnet50"} <= names


def test_capture_summarizes_a_model():
    result = run("capture", "--model", "mlp", "--groups", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["capture"]["ops"] > 0 and out["capture"]["parameters"] > 0
    assert out["groups"]["stats"]


@pytest.mark.slow  # plans searched and checked
def test_plan_save_and_check(tmp_path):
    path = tmp_path / "plan.json"
    result = run(
        "plan",
        "--model",
        "mlp",
        "--set",
        "dtype=float32",
        "--cluster",
        "cpu",
        "--devices",
        "8",
        "--searcher",
        "expert",
        "-o",
        str(path),
    )
    assert result.exit_code == 0, result.output
    assert "mesh" in result.output and "step time" in result.output
    checked = run("apply", str(path), "--check", "--json")
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.output)
    assert report["equal"] is True and report["reduced"] is False


def test_user_errors_are_one_line_with_exit_code_2(tmp_path):
    result = run("plan", "--model", "no-such-model")
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    result = run("apply", str(bad), "--check")
    assert result.exit_code == 2 and "not valid JSON" in result.output
    result = run("plan", "--model", "mlp", "--fn", "x:y")
    assert result.exit_code == 2 and "exactly one of" in result.output


@pytest.mark.slow  # a plan searched and drawn
def test_report_draws_a_saved_plan(tmp_path):
    path = tmp_path / "plan.json"
    made = run(
        "plan",
        "--model",
        "mlp",
        "--cluster",
        "cpu",
        "--devices",
        "8",
        "--searcher",
        "dqn",
        "--budget",
        "1",
        "-o",
        str(path),
    )
    assert made.exit_code == 0, made.output
    html = tmp_path / "report.html"
    result = run("report", str(path), "-o", str(html), "--png", str(tmp_path / "r.png"))
    assert result.exit_code == 0, result.output
    assert "data:image/png;base64," in html.read_text()
    assert (tmp_path / "plan.curve.csv").exists()  # the DQN's curve, drawn in the report
    assert "Learning curve" in html.read_text() or "learning curve" in html.read_text()
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_writes_a_cluster_the_planner_reads(tmp_path):
    out = tmp_path / "cluster.yaml"
    result = run("calibrate", "--devices", "8", "--quick", "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    cal = json.loads(result.output)["calibration"]
    assert cal["devices"] == 8 and cal["matmul_flops"] > 1e8
    assert cal["link_bandwidth"] > 0 and cal["link_latency"] > 0

    cluster = am.Cluster.from_file(out)
    assert cluster.peak_flops == cal["matmul_flops"] and cluster.devices == 8
    planned = run("plan", "--model", "mlp", "--cluster", str(out), "--searcher", "expert", "-q")
    assert planned.exit_code == 0, planned.output


def test_every_command_has_help_an_example_and_option_help():
    import typer

    from automap._cli import app as shared_app

    assert shared_app is app
    top = run("--help")
    assert top.exit_code == 0, top.output
    group = typer.main.get_command(app)
    assert {"plan", "compare", "apply", "verify", "report", "calibrate", "bench"} <= set(
        group.commands
    )
    for name, command in group.commands.items():
        assert name in top.output
        result = run(name, "--help")
        assert result.exit_code == 0, (name, result.output)
        assert "Example: automap " + name in (command.help or ""), name
        for param in command.params:
            if not getattr(param, "hidden", False):
                assert (getattr(param, "help", None) or "").strip(), (name, param.name)


def test_long_commands_take_quiet_and_json():
    import typer

    group = typer.main.get_command(app)
    for name in ("plan", "compare", "apply", "verify", "calibrate", "report", "bench", "capture"):
        flags = {opt for p in group.commands[name].params for opt in getattr(p, "opts", [])}
        assert {"--quiet", "-q", "--json"} <= flags, name


@pytest.mark.parametrize("searcher", sorted(SEARCHERS))
def test_plan_saves_with_every_searcher(tmp_path, searcher):
    """`-o` with any searcher (the default `auto` once refused it: only the DQN keeps a
    search state beside the plan)."""
    path = tmp_path / "p.json"
    args = ("plan", "--model", "mlp", "--set", "layers=2", "--cluster", "cpu", "--devices", "4")
    result = run(*args, "--searcher", searcher, "--budget", "2", "-o", str(path), "-q")
    assert result.exit_code == 0, result.output
    saved = json.loads(path.read_text())
    assert saved["mesh"] and saved["predicted"]["step_time_s"] > 0
    assert (tmp_path / "p.search.msgpack").exists() == (searcher == "dqn")


def _fn_module(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "user_step.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_step:make_step"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", "--model", "mlp", "--devices", "0"), "--devices must be at least 1"),
        (("plan", "--model", "mlp", "--devices", "-3"), "--devices must be at least 1"),
        (("compare", "--model", "mlp", "-n", "0"), "--devices must be at least 1"),
        (("calibrate", "--devices", "0"), "--devices must be at least 1"),
        (("plan", "--model", "mlp", "--budget", "0"), "--budget is seconds"),
        (("compare", "--model", "mlp", "--budget", "-1"), "--budget is seconds"),
        (("bench", "--budget", "0"), "--budget is seconds"),
        (("plan", "--model", "mlp", "--searcher", "nope"), "unknown searcher 'nope'"),
        (("compare", "--model", "mlp", "--searchers", "expert,nope"), "unknown searcher(s) nope"),
        (("plan", "--fn", "no_such_module_here:make"), "cannot import"),
        (("compare", "--model", "mlp", "stray"), "unexpected argument 'stray'"),
    ],
)
def test_more_user_errors_name_the_fix(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_fn_errors_are_one_line(tmp_path, monkeypatch):
    target = _fn_module(tmp_path, monkeypatch, "def make_step():\n    return 42\n")
    result = run("plan", "--fn", target)
    assert result.exit_code == 2 and "must return (step_fn, args)" in result.stderr
    target = _fn_module(tmp_path, monkeypatch, "def make_step(size):\n    return size\n")
    monkeypatch.delitem(__import__("sys").modules, "user_step", raising=False)
    result = run("plan", "--fn", target)
    assert result.exit_code == 2, result.output
    assert "failed with TypeError" in result.stderr and "take no arguments" in result.stderr


@pytest.mark.parametrize("command", ["apply", "verify", "report"])
def test_a_plan_file_that_is_a_directory(tmp_path, command):
    result = run(command, str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "is a directory, not a plan file" in result.stderr


MLP_PLAN = ("plan", "--model", "mlp", "--set", "dtype=float32", "--cluster", "cpu")


def test_json_is_alone_on_stdout_and_quiet_prints_nothing(tmp_path):
    result = run(*MLP_PLAN, "--searcher", "random", "--budget", "0.2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mesh"]
    quiet = run(*MLP_PLAN, "--searcher", "expert", "-q", "-o", str(tmp_path / "p.json"))
    assert quiet.exit_code == 0 and quiet.output == ""
    assert (tmp_path / "p.json").exists()


def test_compare_json_to_stdout_to_a_file_and_the_old_spelling(tmp_path):
    base = ("compare", "--model", "mlp", "--cluster", "cpu", "--searchers", "expert,random")
    result = run(*base, "--budget", "0.2", "--json")
    assert result.exit_code == 0, result.output
    assert {r["searcher"] for r in json.loads(result.stdout)["rows"]} == {"expert", "random"}
    out = tmp_path / "rows.json"
    result = run(*base, "--budget", "0.2", "--json-out", str(out), "-q")
    assert result.exit_code == 0 and result.output == "" and json.loads(out.read_text())["rows"]
    old = tmp_path / "old.json"
    result = run(*base, "--budget", "0.2", "--json", str(old))
    assert result.exit_code == 0, result.output
    assert json.loads(old.read_text())["rows"] and "--json-out" in result.stderr
    assert "random" in result.stdout  # the table, as `--json FILE` always printed


def _interrupt_at(monkeypatch, n: int) -> None:
    """Ctrl-C without a signal: the n-th evaluation of a whole plan raises KeyboardInterrupt."""
    from automap._space import ShardSpace

    real, calls = ShardSpace.evaluate, [0]

    def evaluate(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardSpace, "evaluate", evaluate)


@pytest.mark.parametrize("searcher", ["random", "dqn"])
def test_ctrl_c_in_plan_saves_the_best_plan_so_far(tmp_path, monkeypatch, searcher):

    _interrupt_at(monkeypatch, 12)
    path = tmp_path / "best.json"
    result = run(*MLP_PLAN, "--searcher", searcher, "--budget", "60", "-o", str(path))
    assert result.exit_code == 130, result.output
    # The last line: a loaded machine may log a progress line first (10 s in).
    assert (
        result.stderr.splitlines()[-1]
        == f"search interrupted: the best plan so far is saved to {path}"
    )
    assert result.stdout == ""
    plan = am.Plan.load(path)
    assert plan.decisions["interrupted"] is True and plan.predicted.feasible


def test_ctrl_c_in_plan_without_output_keeps_an_existing_plan_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("mine")
    _interrupt_at(monkeypatch, 12)
    result = run(*MLP_PLAN, "--searcher", "random", "--json")
    assert result.exit_code == 130, result.output
    assert (tmp_path / "plan.json").read_text() == "mine"
    assert "saved to plan-1.json" in result.stderr
    assert json.loads(result.stdout)["mesh"]  # --json still prints the plan, alone
    _interrupt_at(monkeypatch, 1)
    result = run(*MLP_PLAN, "--searcher", "random")
    assert result.exit_code == 130 and "before any feasible plan" in result.stderr


def test_ctrl_c_in_compare_keeps_the_rows_so_far(monkeypatch):
    _interrupt_at(monkeypatch, 12)
    searchers = ("--searchers", "expert,random,mcmc", "--budget", "60", "--json")
    result = run("compare", "--model", "mlp", "--cluster", "cpu", *searchers)
    assert result.exit_code == 130, result.output
    out = json.loads(result.stdout)
    assert out["interrupted"] is True
    assert [r["searcher"] for r in out["rows"]][-1] == "random"  # mcmc never started
    assert out["rows"][-1]["note"].startswith("interrupted") and out["rows"][-1]["feasible"]
    assert "comparison interrupted" in result.stderr


MLP_DQN = ("plan", "--model", "mlp", "--set", "layers=2", "--set", "hidden=64")
MLP_DQN += ("--cluster", "cpu", "--devices", "8", "--searcher", "dqn", "--seed", "1", "--quiet")


def test_plan_resume_continues_the_saved_search(tmp_path):
    path = tmp_path / "plan.json"
    state = tmp_path / "plan.search.msgpack"
    first = run(*MLP_DQN, "--budget", "0.5", "-o", str(path))
    assert first.exit_code == 0, first.output
    assert state.exists()
    more = run(*MLP_DQN, "--budget", "1", "-o", str(path), "--resume")
    assert more.exit_code == 0, more.output
    resumed = json.loads(path.read_text())["decisions"]
    assert resumed["episodes"] == 40  # 20 from the first run, 20 more: the total budget
    whole = run(*MLP_DQN, "--budget", "1", "-o", str(tmp_path / "whole.json"))
    assert whole.exit_code == 0, whole.output
    unbroken = json.loads((tmp_path / "whole.json").read_text())["decisions"]
    assert [r["current_time"] for r in resumed["curve"]] == [
        r["current_time"] for r in unbroken["curve"]
    ]


def test_plan_resume_and_agent_errors_are_one_line(tmp_path):
    no_output = run(*MLP_DQN, "--budget", "0.5", "--resume")
    assert no_output.exit_code == 2 and "--resume needs -o" in no_output.output
    nothing = run(*MLP_DQN, "--budget", "0.5", "--resume", "-o", str(tmp_path / "p.json"))
    assert nothing.exit_code == 2 and "without --resume first" in nothing.output
    bad = tmp_path / "agent.msgpack"
    bad.write_text("not an agent")
    corrupt = run(*MLP_DQN, "--budget", "0.5", "--agent", str(bad))
    assert corrupt.exit_code == 2 and "--save-agent" in corrupt.output
    assert "Traceback" not in corrupt.output


def test_plan_saves_an_agent_that_warm_starts_another_plan(tmp_path):
    agent = tmp_path / "agent.msgpack"
    saved = run(*MLP_DQN, "--budget", "0.5", "--save-agent", str(agent))
    assert saved.exit_code == 0, saved.output
    assert agent.stat().st_size > 0
    warm = run(*MLP_DQN, "--budget", "0.5", "--agent", str(agent), "--json")
    assert warm.exit_code == 0, warm.output
    assert json.loads(warm.output)["predicted"]["feasible"]


# Writes that fail after the work (issue 28): the answer is printed first, the file goes
# where Ctrl-C keeps one, one line on stderr says so, and the exit code is 1.
# /dev/full stands in for a full disk: it opens, and every write fails with ENOSPC.
FULL = "/dev/full"
needs_dev_full = pytest.mark.skipif(
    not os.path.exists(FULL), reason="no /dev/full to stand in for a full disk"
)
MLP = ("--model", "mlp", "--set", "layers=2", "--set", "dtype=float32", "--cluster", "cpu")


@needs_dev_full
def test_a_plan_written_to_a_full_disk_is_printed_and_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("plan", *MLP, "--searcher", "expert", "-o", FULL)
    assert result.exit_code == 1, result.output
    assert "step time" in result.stdout and "Traceback" not in result.output
    assert result.stderr.strip() == (
        f"error: plan could not be written to {FULL} (No space left on device); "
        "it is saved to plan.json instead."
    )
    assert am.Plan.load(tmp_path / "plan.json").predicted.feasible


@needs_dev_full
def test_plan_json_on_a_full_disk_prints_the_json_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("the user's own")
    result = run("plan", *MLP, "--searcher", "expert", "--json", "-o", FULL)
    assert result.exit_code == 1, result.output
    printed = json.loads(result.stdout)
    assert "saved to plan-1.json instead" in result.stderr  # never over the user's file
    assert (tmp_path / "plan.json").read_text() == "the user's own"
    assert am.Plan.load(tmp_path / "plan-1.json").mesh == printed["mesh"]


def test_a_dqn_state_that_cannot_be_written_keeps_the_plan(tmp_path):
    """The DQN writes its search state inside the search: a failure there is one line
    after the answer, the plan and curve are saved, nothing half-written is left."""
    (tmp_path / "p.search.msgpack.tmp").mkdir()  # the state's write fails on it
    out = tmp_path / "p.json"
    result = run("plan", *MLP, "--searcher", "dqn", "--budget", "0.5", "-o", str(out))
    assert result.exit_code == 1, result.output
    assert "step time" in result.stdout and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr  # besides progress lines, on a loaded machine
    assert errors[0].startswith(f"error: the search state could not be written to {out.parent}")
    assert am.Plan.load(out).predicted.feasible and (tmp_path / "p.curve.csv").exists()
    assert not (tmp_path / "p.search.msgpack").exists()


@needs_dev_full
def test_compare_prints_its_rows_before_a_full_disk_loses_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("compare", *MLP, "--searchers", "expert", "--budget", "1", "--json-out", FULL)
    assert result.exit_code == 1, result.output
    assert "data_parallel" in result.stdout and "Traceback" not in result.output
    assert result.stderr.strip().endswith("it is saved to rows.json instead.")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert any(r["plan_name"] == "data_parallel" for r in rows["rows"])


@needs_dev_full
def test_calibrate_to_a_full_disk_prints_and_keeps_the_cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("calibrate", "--devices", "8", "--quick", "-o", FULL)
    assert result.exit_code == 1, result.output
    assert "GFLOP/s" in result.stdout
    assert result.stderr.strip().endswith("it is saved to cluster.yaml instead.")
    assert am.Cluster.from_file(tmp_path / "cluster.yaml").devices == 8


@pytest.mark.parametrize("searcher", ["dp", "auto"])
def test_ctrl_c_before_dp_finds_a_plan_keeps_the_best_expert(tmp_path, monkeypatch, searcher):
    """Ctrl-C (or SIGTERM) in auto or dp before its ILP or stage DP found a plan: the best
    feasible expert plan is the best so far, saved as Ctrl-C saves any (issue 28), not
    "nothing saved", so an interrupted run is never worse than an expert either."""
    from automap._zoo import get_model

    _interrupt_at(monkeypatch, 1)  # the ILP's first pricing
    path = tmp_path / "best.json"
    result = run("plan", *MLP, "--searcher", searcher, "--budget", "5", "-o", str(path))
    assert result.exit_code == 130, result.output
    # The last line: a loaded machine may log a progress line first (10 s in).
    assert (
        result.stderr.splitlines()[-1]
        == f"search interrupted: the best plan so far is saved to {path}"
    )
    plan = am.Plan.load(path)
    assert plan.decisions["interrupted"] is True and plan.predicted.feasible
    assert plan.provenance.searcher == searcher
    spec = get_model("mlp", layers=2, dtype="float32")
    cpu = am.Cluster.preset("cpu", devices=8)
    experts = am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=cpu).values()
    fastest = min(p.predicted.step_time_s for p in experts if p.predicted.feasible)
    assert plan.predicted.step_time_s == pytest.approx(fastest)
