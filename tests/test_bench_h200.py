"""`benchmarks/bench_h200.py`: its three commands hold together on this machine. The GPU
is lent to few sessions, so what it measured is committed (benchmarks/h200/) and
BENCHMARKS.md's table is `report` over those files; here the plans `predict` writes run
through the `step` command (`am.apply` on the CPU), and `report` reads what `measure`
writes, so a change to either end cannot leave the other reading nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    (
        "gpt tiny full",
        "gpt-1.3b",
        {"batch": 2, "layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128},
        {"remat": "full"},
    ),
)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_h200")


def test_the_priced_plan_runs_and_the_report_reads_the_measurement(
    bench, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(bench, "CONFIGS", TINY)
    predicted, measured = tmp_path / "predicted.json", tmp_path / "measured.json"
    bench.predict(predicted)
    config = json.loads(predicted.read_text())["configs"][0]
    assert config["feasible"] and config["gemms"]
    assert config["matmul_s"] + config["kernels_s"] <= config["compute_s"] * (1 + 1e-9)
    bench.measure(predicted, measured, kernels=False)  # the step, in a process of its own
    got = json.loads(measured.read_text())
    step = got["steps"]["gpt tiny full"]
    assert "error" not in step, step.get("error")
    assert step["step_s"] > 0 and len(step["steps_s"]) == bench.STEPS
    got |= {"hbm_bytes_per_s": 1e12, "gemms": {key: 1e-3 for key in config["gemms"]}}
    measured.write_text(json.dumps(got))
    capsys.readouterr()
    bench.report(predicted, measured)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| gpt tiny full |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert float(cells[3]) == pytest.approx(step["step_s"] / config["step_s"], rel=0.01, abs=0.01)
    alone = sum(v["count"] for v in config["gemms"].values()) * 1e-3
    assert float(cells[7]) == pytest.approx(alone, abs=1e-3)


def test_the_committed_measurement_covers_every_priced_configuration(bench, capsys):
    predicted = ROOT / "benchmarks" / "h200" / "predicted.json"
    measured = ROOT / "benchmarks" / "h200" / "measured.json"
    names = [c["name"] for c in json.loads(predicted.read_text())["configs"]]
    got = json.loads(measured.read_text())
    assert sorted(got["steps"]) == sorted(names)
    assert all("step_s" in got["steps"][name] for name in names)
    bench.report(predicted, measured)
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in names)
    assert "—" not in out  # every GEMM of every configuration was timed
