"""The `automap` command line, driven in-process."""

import json

from typer.testing import CliRunner

from automap._cli import app

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
    import automap as am

    cluster = am.Cluster.from_file(out)
    assert cluster.peak_flops == cal["matmul_flops"] and cluster.devices == 8
    planned = run("plan", "--model", "mlp", "--cluster", str(out), "--searcher", "expert", "-q")
    assert planned.exit_code == 0, planned.output
