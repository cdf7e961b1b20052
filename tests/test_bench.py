"""`automap bench`: a tiny run gives the tables, the header and JSON rows; t-1% is read right;
Megatron-LM's published table renders from its rows."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from automap._bench import (
    MEGATRON_TABLE,
    QUICK,
    Case,
    Row,
    Settings,
    megatron_lines,
    model_flops,
    run_bench,
    select,
    select_rows,
    to_markdown,
    within_1pct,
    write,
)
from automap._cli import app
from automap._plan import Plan, Provenance

TINY = dict(layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=512)


@pytest.fixture(scope="module")
def result():
    # One small zoo variant with tiny budgets; fidelity on one MLP plan, speed on the MLP.
    case = Case("bert-base", "a100", 8, TINY)
    settings = Settings(0.1, 1, ("mlp",), 1, "mlp", "automap bench --tiny", dp_budget_s=10.0)
    return run_bench([case], settings, progress=False)


@pytest.mark.slow  # a tiny bench run (24 s loaded)
def test_markdown_has_header_and_tables(result, tmp_path):
    out, js = tmp_path / "B.md", tmp_path / "b.json"
    write(result, out, js)
    text = out.read_text()
    assert text == to_markdown(result)
    for field in ("| command | `automap bench --tiny` |", "| date |", "| machine |", "jax "):
        assert field in text
    assert "## Plans: every searcher against the exact optimum" in text
    assert "| bert-base layers=2" in text and "a100 × 8" in text
    assert "| mlp | 1 |" in text  # the fidelity table's row
    assert "plans/s" in text
    case = json.loads(js.read_text())["cases"][0]
    assert case["optimum"]["proof"].startswith("ILP optimal")
    assert "exhaustive agrees" in case["optimum"]["proof"]  # the tiny space is enumerable
    assert set(case["searchers"]) == {"dqn", "random", "mcmc"}
    for runs in case["searchers"].values():
        assert runs[0]["ratio"] >= 1 - 1e-9  # nothing beats the proven optimum
    keys = {"searcher", "plan_name", "step_time_s", "memory_bytes", "feasible", "seed"}
    assert all(keys <= set(row) for row in case["rows"])
    assert {r["searcher"] for r in case["rows"]} >= {"expert", "ilp", "exhaustive", "dqn", "dp"}


@pytest.mark.slow  # the same bench run
def test_hybrid_column_is_the_dp_searchers_answer(result):
    case = result["cases"][0]
    hybrid, optimum = case["hybrid"], case["optimum"]
    # The dp searcher returns the faster of the one-stage optimum and its best pipeline.
    assert hybrid["time_s"] <= optimum["time_s"] * (1 + 1e-9)
    assert hybrid["ratio"] == pytest.approx(hybrid["time_s"] / optimum["time_s"])
    piped = [r for r in case["rows"] if r["searcher"] == "dp"]
    assert len(piped) == 1
    if piped[0]["feasible"]:  # the pipeline row: stages in its plan and in its shape
        assert piped[0]["stages"] >= 2 and piped[0]["shape"].startswith("pipe ")
        assert hybrid["pipeline_s"] == pytest.approx(piped[0]["step_time_s"])
    assert hybrid["stages"] >= 1 and hybrid["microbatches"] >= 1
    text = to_markdown(result)
    assert "| hybrid |" in text and "Hybrid: the `dp` searcher" in text
    shape = (
        f"{hybrid['stages']} stages × {hybrid['microbatches']} mb"
        if hybrid["stages"] > 1
        else "1 stage, "
    )
    assert shape in text
    # Pipeline experts are in the expert column's candidates.
    names = {r["plan_name"] for r in case["rows"] if r["searcher"] == "expert"}
    assert "gpipe_uniform" in names


def _row(curve: list[dict], evaluated: int, seconds: float) -> Row:
    plan = Plan(
        name="random",
        mesh={"data": 8},
        specs={},
        decisions={"curve": curve, "evaluated": evaluated},
        provenance=Provenance(searcher="random", search_time_s=seconds),
    )
    return Row("random", "random", 1.0, 0.0, True, seconds, None, plan)


def test_time_to_1pct_from_evaluations_and_from_elapsed():
    inf = float("inf")
    curve = [{"episode": i, "best_time": b, "current_time": b} for i, b in [(1, inf), (2, 2.0)]]
    curve.append({"episode": 3, "best_time": 1.005, "current_time": 1.005})
    # Random/MCMC curves count evaluations: 3 of 10 in 2 s.
    assert within_1pct(_row(curve, 10, 2.0), 1.0) == (pytest.approx(0.6), 3)
    assert within_1pct(_row(curve[:2], 10, 2.0), 1.0) is None
    # DQN rows carry their own clock; an infeasible episode's time never counts.
    dqn = [
        {"episode": 1, "elapsed_s": 0.1, "best_time": 0.5, "current_time": 0.5, "feasible": False},
        {"episode": 2, "elapsed_s": 0.2, "best_time": 1.0, "current_time": 1.0, "feasible": True},
    ]
    assert within_1pct(_row(dqn, 2, 1.0), 1.0) == (0.2, 2)


def test_select_and_cli_errors():
    assert [c.model for c in select(QUICK, ["t5-base"])] == ["t5-base"]
    assert {c.label for c in select(QUICK, ["gpt-6.7b"])} == {
        "a100 × 64",
        "h100 × 64",
    }
    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "--seeds", "0"])
    assert bad.exit_code == 2 and "--seeds" in bad.output
    unknown = runner.invoke(app, ["bench", "--models", "nope"])
    assert unknown.exit_code == 2 and "unknown model" in unknown.output


def _megatron_row(params_b, tp, pp, dp, published, predicted, **planned):
    step = 10.0
    return {
        "params_b": params_b, "heads": 8, "hidden": 1024, "layers": 8, "tp": tp, "pp": pp,
        "gpus": tp * pp * dp, "batch": 64, "published": published, "dp": dp,
        "predicted_tflops": predicted, "ratio": predicted / published, "step_s": step,
        "memory_gb": 40.25, "feasible": True, "price_s": 1.0,
        "megatron_ratio": 0.95 * predicted / published, "modern_step_s": 8.5,
        "modern_feasible": True, **planned,
    }  # fmt: skip


def _fake_result(megatron):
    """The smallest result `to_markdown` renders: no cases, nothing else run."""
    machine = dict(cpu="cpu", cores=2, memory_bytes=None, python="3", jax="0", automap="0")
    return {
        "machine": {**machine, "commit": None, "date": "today"},
        "command": "automap bench",
        "settings": {"budget_s": 1.0, "seeds": 1},
        "wall_s": 60.0,
        "cases": [],
        "fidelity": "not run",
        "speed": "not run",
        "megatron": megatron,
    }


def test_megatron_section_from_a_fake_result():
    planned = _megatron_row(
        1.7, 1, 1, 32, 137, 110.0,
        plan="data 32 (ZeRO-1)", plan_step_s=8.0, plan_feasible=True, vs_modern=0.94,
        plan_wall_s=31.4, plan_peak_gb=2.5,
    )  # fmt: skip
    failed = _megatron_row(1008, 8, 64, 6, 163, 140.0, plan_error="x | y", plan_wall_s=12.0)
    section = {"cluster": "a100", "plan_s": 30.0, "searcher": "auto", "rows": [planned, failed]}
    text = to_markdown(_fake_result(section))
    assert "## Megatron-LM's published table" in text
    assert "`automap plan --searcher auto --budget 30`" in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| params (B) |"))
    assert lines[head].count("|") == lines[head + 1].count("|") == 18
    assert lines[head + 2] == (
        "| 1.7 | 1 × 1 × 32 | 32 | 64 | 137 | 110 | 0.80 | 10.00 | 40.2 | yes | 0.76 | 8.50 "
        "| data 32 (ZeRO-1) | 8.00 | 0.94 | 31 | 2.5 |"
    )
    # A row the planner failed on says why (a `|` would break the table) and keeps its price.
    assert lines[head + 3].startswith("| 1008 | 8 × 64 × 6 | 3072 | 64 | 163 | 140 | 0.86 |")
    assert "| x / y | — | — | 12 | — |" in lines[head + 3]
    # Priced only: no planner columns; not run: one line saying how to run it.
    priced = to_markdown(_fake_result({**section, "plan_s": 0.0, "rows": [failed]}))
    assert "planner" not in priced.split("## Megatron")[1].splitlines()[4]
    assert megatron_lines("not run")[-1] == "Megatron table: not run."
    # A result saved before the section existed renders without it.
    old = _fake_result(section)
    del old["megatron"]
    assert "Megatron-LM's published table" not in to_markdown(old)


def test_megatron_rows_and_flop_count():
    assert len(MEGATRON_TABLE) == 9 and [r.params_b for r in select_rows(["1.7", "1008"])] == [
        1.7,
        1008,
    ]
    assert all(r.tp * r.pp * r.dp == r.gpus for r in MEGATRON_TABLE)
    # The paper's count for its 1.7B row: 512 sequences of 2048 tokens, 24 layers of 2304.
    row = MEGATRON_TABLE[0]
    assert model_flops(row) == pytest.approx(
        96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    )
    bad = CliRunner().invoke(app, ["bench", "--megatron-plan-s", "-1"])
    assert bad.exit_code == 2 and "--megatron-plan-s" in bad.output


def test_bench_results_survive_a_full_disk(tmp_path, monkeypatch):
    """Minutes of benchmarks end in a write: --out on a full disk (/dev/full stands in)
    keeps the tables in a new BENCHMARKS.md here and says so in one line, exit 1; a path
    that cannot be written is refused before anything runs (issue 28)."""
    import os

    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(
        "automap._bench.run_bench", lambda *a, **k: ran.append(1) or _fake_result("not run")
    )
    runner = CliRunner()
    missing = runner.invoke(app, ["bench", "--models", "mlp", "--out", "nowhere/B.md"])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr and not ran
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to stand in for a full disk")
    (tmp_path / "BENCHMARKS.md").write_text("an older run")
    full = runner.invoke(app, ["bench", "--models", "mlp", "--out", "/dev/full"])
    assert full.exit_code == 1 and ran, full.output
    assert full.stderr.strip() == (
        "error: benchmarks could not be written to /dev/full (No space left on device); "
        "it is saved to BENCHMARKS-1.md instead."
    )
    assert (tmp_path / "BENCHMARKS.md").read_text() == "an older run"
    assert "automap bench" in (tmp_path / "BENCHMARKS-1.md").read_text()


def test_a_rewrite_keeps_what_was_recorded_apart(tmp_path, monkeypatch):
    """BENCHMARKS.md holds measurements `automap bench` cannot take again (a lent GPU's, the
    planner's walls on an idle machine): a rewrite replaces the tables above the line and
    keeps what is below it, word for word; a file without the line is replaced whole."""
    from automap._bench import RECORDED_APART

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("automap._bench.run_bench", lambda *a, **k: _fake_result("not run"))
    apart = f"{RECORDED_APART}\n\n## One H200, measured\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# an older run\n\nold tables\n\n" + apart)
    done = CliRunner().invoke(app, ["bench", "--models", "mlp", "--out", str(out)])
    assert done.exit_code == 0, done.output
    text = out.read_text()
    assert "old tables" not in text and text.startswith("# Auto-MAP benchmarks")
    assert text.endswith(apart) and text.count(RECORDED_APART) == 1
    out.write_text("# no line\n")
    assert CliRunner().invoke(app, ["bench", "--models", "mlp", "--out", str(out)]).exit_code == 0
    assert RECORDED_APART not in out.read_text() and "# no line" not in out.read_text()
