"""MaxText's published v5p table: its rows, MaxText's TFLOP count by hand, the markdown
from fake records, and one row priced on abstract shapes with MaxText's configuration."""

from __future__ import annotations

import pytest

from automap._bench import (
    MAXTEXT_TABLE,
    PlanJob,
    maxtext_flops,
    maxtext_lines,
    maxtext_table,
    plan_isolated,
    select_maxtext_rows,
)
from automap._errors import AutomapError

V5P_PEAK_TFLOPS = 459  # the MFU column's denominator


def test_rows_as_published():
    assert [r.name for r in select_maxtext_rows(["32b", "128B"])] == ["32B", "128B"]
    assert select_maxtext_rows(["7B"]) == ()
    assert [(r.chips, r.batch) for r in MAXTEXT_TABLE] == [(64, 384), (64, 192), (128, 128)]
    assert [r.slice_name for r in MAXTEXT_TABLE] == ["v5p-128", "v5p-128", "v5p-256"]
    for r in MAXTEXT_TABLE:  # TFLOP/s rounded to a whole number: MFU within ±0.5 of it
        assert abs(100 * r.published / V5P_PEAK_TFLOPS - r.mfu) < 100 * 0.5 / V5P_PEAK_TFLOPS


def test_flop_count_by_hand_for_32b():
    # 6 sequences of 2048 per chip; 32 layers of 8192 with 64 heads of 128 and SwiGLU
    # 28,672; vocabulary 32,000. Weight FLOPs are 6 per weight per token over every
    # weight MaxText counts (all but the input embedding); causal attention is 3 × half
    # of 4·b·s²·heads·head_dim per layer.
    tokens = 6 * 2048
    layer_weights = 4 * 8192 * 8192 + 3 * 8192 * 28672
    weights = 32 * layer_weights + 8192 * 32000
    attention = 3 * 32 * (4 * 6 * 2048**2 * 8192) / 2
    row = select_maxtext_rows(["32B"])[0]
    assert maxtext_flops(row) == pytest.approx(6 * weights * tokens + attention, rel=1e-12)
    # At the published 328 TFLOP/s, a step of about 7.2 s.
    assert maxtext_flops(row) / 328e12 == pytest.approx(7.18, abs=0.01)


def _record(name, predicted, **planned):
    row = select_maxtext_rows([name])[0]
    return {
        "name": name,
        "slice": row.slice_name,
        "chips": row.chips,
        "fsdp": row.fsdp,
        "tensor": row.tensor,
        "per_chip_batch": row.per_chip_batch,
        "batch": row.batch,
        "published": row.published,
        "predicted_tflops": predicted,
        "ratio": predicted / row.published,
        "step_s": maxtext_flops(row) / predicted / 1e12,
        "memory_gb": 80.5,
        "feasible": True,
        **planned,
    }


def test_markdown_from_fake_records():
    planned = _record(
        "32B",
        300.0,
        plan="data 16 × model 4 (remat, ZeRO-3)",
        plan_step_s=7.5,
        plan_feasible=True,
        vs_maxtext=0.96,
        plan_wall_s=90.0,
        plan_peak_gb=3.25,
    )
    failed = _record("128B", 250.0, plan_error="no plan | fits", plan_wall_s=120.0)
    section = {"remat": "projections", "plan_s": 120.0, "searcher": "auto"}
    lines = maxtext_lines({**section, "rows": [planned, failed]})
    assert "--budget 120" in lines[0] and "remat `projections`" in lines[0]
    assert lines[2].count("|") == lines[3].count("|") == 17
    assert lines[4].startswith("| 32B | v5p-128 (64) | 16 × 4 | 6 (384) | 328 | 300 | 0.91 |")
    assert "| data 16 × model 4 (remat, ZeRO-3) | 7.50 | 0.96 | yes | 90 | 3.2 |" in lines[4]
    # The planner's error keeps the table's columns: its own bar is no column.
    assert "none: no plan / fits" in lines[5] and lines[5].count("|") == 17
    unplanned = maxtext_lines({**section, "plan_s": 0.0, "rows": [planned]})
    assert "Planner" not in unplanned[0] and unplanned[2].count("|") == 11
    assert unplanned[4].count("|") == 11
    assert maxtext_lines("not run") == ["MaxText table: not run."]


@pytest.mark.slow  # a 32-layer Llama captured and priced (about 20 s loaded)
def test_32b_priced_with_maxtexts_configuration():
    row = select_maxtext_rows(["32B"])[0]
    section = maxtext_table([row])
    (rec,) = section["rows"]
    assert section["cluster"] == "tpu-v5p" and section["remat"] == "projections"
    assert rec["config"] == "data 16 × model 4 (SP, remat projections, flash, ZeRO-3)"
    # MaxText runs it in a v5p's 95 GiB: with its `minimal` policy (our "projections") and
    # its residual stream split over `tensor`, so does the memory model (74.5 GB; 253 GB
    # with "selective" and the stream whole).
    assert rec["feasible"] and rec["memory_gb"] < 95 * 2**30 / 1e9
    # ZeRO-3 over 16 and tensor parallel over 4: float32 parameters, 31.66B of them,
    # a 64th of them on each chip.
    params = 32 * (4 * 8192**2 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 32000 * 8192 + 8192
    assert rec["params_gb"] == pytest.approx(4 * params / 64 / 1e9, rel=0.02)
    assert rec["predicted_tflops"] * rec["step_s"] * 1e12 == pytest.approx(maxtext_flops(row))
    assert rec["ratio"] == pytest.approx(rec["predicted_tflops"] / 328)
    assert rec["step_s"] >= rec["compute_s"] > 0 and rec["comm_s"] > 0


def test_planner_child_fails_in_one_line():
    # The child process's error comes back as the parent's one-line AutomapError.
    wrong = PlanJob("llama-32b", {}, "tpu-v5p", 64, "4x4x5")
    with pytest.raises(AutomapError, match=r"the planner failed: .*4x4x5 are 80 chips, not 64"):
        plan_isolated(wrong, 1.0)
