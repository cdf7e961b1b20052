"""Korthikanti et al.'s table (sequence parallelism + selective recomputation against full
recomputation): its rows, their published configurations priced, and its markdown."""

from __future__ import annotations

import pytest

from automap._bench import (
    KORTHIKANTI_TABLE,
    korthikanti_lines,
    korthikanti_table,
    select_korthikanti_rows,
    to_markdown,
)


def test_rows_are_the_published_configurations():
    assert [r.name for r in KORTHIKANTI_TABLE] == ["22B", "175B", "530B", "1T"]
    for r in KORTHIKANTI_TABLE:
        assert r.gpus == r.tp * r.pp  # data parallel 1 on every row
        assert r.batch % r.microbatch == 0 and r.layers % (r.pp * r.virtual) == 0
        # The paper's speedups of SP + selective over full recomputation: 1.29 to 1.32.
        assert 1.28 < r.published_speedup < 1.33
    assert [r.name for r in select_korthikanti_rows(["1T", "22B"])] == ["22B", "1T"]


def _record(name, full_pred, modern_pred, **planned):
    row = next(r for r in KORTHIKANTI_TABLE if r.name == name)
    return {
        "name": row.name, "tp": row.tp, "pp": row.pp, "gpus": row.gpus, "batch": row.batch,
        "microbatch": row.microbatch, "virtual": row.virtual, "full_s": row.full_s,
        "modern_s": row.modern_s, "full_pred_s": full_pred, "modern_pred_s": modern_pred,
        "full_ratio": full_pred / row.full_s, "modern_ratio": modern_pred / row.modern_s,
        "published_speedup": row.published_speedup,
        "predicted_speedup": full_pred / modern_pred, "full_memory_gb": 60.0,
        "modern_memory_gb": 40.0, "feasible": True, "price_s": 1.0, **planned,
    }  # fmt: skip


def test_section_renders_from_its_records():
    planned = _record(
        "175B", 18.0, 14.0, plan="data 1 × model 8 × 8 stages", plan_step_s=13.0,
        plan_feasible=True, vs_published=13.0 / 14.0, plan_wall_s=80.0, plan_peak_gb=3.0,
    )  # fmt: skip
    failed = _record("1T", 100.0, 75.0, plan_error="none fits | at all", plan_wall_s=9.0)
    section = {
        "cluster": "a100", "plan_s": 60.0, "searcher": "auto", "rows": [planned, failed],
        "mean_abs_error": 0.04,
    }  # fmt: skip
    lines = korthikanti_lines(section)
    head = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    assert lines[head].count("|") == lines[head + 1].count("|") == 21
    assert lines[head + 2].startswith(
        "| 175B | 8 × 8 | 64 | 64 | 1 | 3 | 18.13 | 18.00 | 0.99 | 13.75 | 14.00 | 1.02 "
        "| 1.32 | 1.29 | 60 → 40 | data 1 × model 8 × 8 stages | 13.00 | 0.93 |"
    )
    assert "| none fits / at all | — | — | 9 | — |" in lines[head + 3]
    assert lines[-1] == "Mean absolute error of the priced times: 4.0%."
    assert korthikanti_lines("not run")[-1] == "Korthikanti table: not run."
    result = {
        "machine": {"cpu": "cpu", "cores": 2, "memory_bytes": None, "python": "3", "jax": "0",
                    "automap": "0", "commit": None, "date": "today"},
        "command": "automap bench", "settings": {"budget_s": 1.0, "seeds": 1}, "wall_s": 1.0,
        "cases": [], "fidelity": "not run", "speed": "not run", "megatron": "not run",
        "korthikanti": section,
    }  # fmt: skip
    assert "## Sequence parallelism and selective recomputation" in to_markdown(result)


@pytest.mark.slow
def test_the_22b_row_is_priced_in_both_columns():
    """Both published configurations of the one-stage row priced on abstract shapes:
    sequence parallelism with selective recomputation must come out faster than full
    recomputation (the paper measures 1.29x) and hold less than full recomputation's
    kept activations plus the attention scores it no longer stores."""
    section = korthikanti_table(select_korthikanti_rows(["22B"]))
    (r,) = section["rows"]
    assert r["feasible"]
    assert r["predicted_speedup"] > 1.0
    assert r["full_pred_s"] > r["modern_pred_s"] > 0
    assert section["mean_abs_error"] == pytest.approx(
        (abs(r["full_ratio"] - 1) + abs(r["modern_ratio"] - 1)) / 2
    )
