"""`automap verify --numerics` on a model too big to run here checks the numbers on a
reduced variant, as `apply --check` does; a verify child killed by a signal says so in
one line (issue 28, item 4.7)."""

from __future__ import annotations

import json
import subprocess

import pytest

import automap as am
from automap._verify import subprocess_main, verify_in_subprocess
from automap._zoo import get_model

SMALL = dict(layers=4, hidden=64, heads=4, batch=8, seq=16, vocab=128, dtype="float32")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    spec = get_model("gpt-1.3b", **SMALL)
    cluster = am.Cluster.preset("cpu", devices=2)
    plan = am.plan_recipe(
        spec.step_fn, *spec.abstract_args(), recipe=am.Recipe(tp=2), cluster=cluster,
        origin={"model": "gpt-1.3b", "overrides": SMALL},
    )  # fmt: skip
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def test_numerics_of_a_big_model_run_on_a_reduced_variant(plan_file, monkeypatch, capsys):
    # This model counts as big: over the reduced check's limit.
    monkeypatch.setattr("automap._verify._saved.MAX_CHECK_PARAMS", 1000)
    subprocess_main([str(plan_file), "--concrete"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    report = am.VerifyReport.from_dict(json.loads(line.split(" ", 1)[1]))
    assert report.numerics_ok is True and report.collectives_match
    (note,) = [n for n in report.notes if n.startswith("numerics on a reduced variant")]
    assert "layers=2" in note and "hidden=64" in note


def test_a_child_killed_by_a_signal_is_one_line(plan_file, monkeypatch):
    def killed(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, -9, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", killed)
    with pytest.raises(am.AutomapError, match=r"killed by SIGKILL \(out of memory\?\)") as e:
        verify_in_subprocess(plan_file, concrete=True)
    assert "\n" not in str(e.value)
