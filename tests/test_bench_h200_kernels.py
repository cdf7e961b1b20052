"""`benchmarks/bench_h200_kernels.py`: what it measures on a GPU is committed
(benchmarks/h200/kernels.json), so here its readers are held: the profile reader sums a
perfetto trace's GPU kernels by kind per step and leaves the host's events out, the
report reads the committed file, and the kernels it times run (on the CPU, tiny)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_h200_kernels")


def trace(tmp_path: Path) -> Path:
    """A perfetto trace as JAX writes one on a GPU: a host process and a device process
    with a compute stream and an annotation thread over the same time."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {
            "ph": "M",
            "pid": 2,
            "tid": 7,
            "name": "thread_name",
            "args": {"name": "Stream #14(Compute)"},
        },
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    x = [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 2, 7, 600.0),
        ("loop_transpose_fusion_24", 2, 7, 300.0),
        ("input_reduce_fusion_46", 2, 7, 100.0),
        ("fusion.12", 2, 8, 1000.0),  # an annotation, not a kernel
        ("PjitFunction(step)", 1, 3, 5000.0),  # the host
    ]
    events = meta + [
        {"ph": "X", "pid": p, "tid": t, "ts": 0, "dur": d, "name": n} for n, p, t, d in x
    ]
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path


def test_a_profile_is_summed_by_kind_per_step_on_the_gpus_streams(bench, tmp_path):
    got = bench.gpu_kernels(str(trace(tmp_path)), steps=2)
    assert got["kinds"] == pytest.approx({"gemm": 300e-6, "copy": 150e-6, "fusion": 50e-6})
    assert got["processes"] == ["/device:GPU:0", "/host:CPU"]
    assert got["top"][0][1] == "fusion.12"  # listed by name with its thread, not summed


def test_the_report_reads_the_committed_measurement(bench, capsys):
    bench.report(ROOT / "benchmarks" / "h200" / "kernels.json")
    out = capsys.readouterr().out
    for name in bench.PROFILED:
        assert f"| {name} |" in out
    assert "| 1x8192x8192x8192 |" in out and "| llama-8b b2:cudnn |" in out


def test_the_timed_kernels_run(bench):
    assert bench.gemm_seconds(2, 64, 32, 16) > 0
    row = bench.attention_row(1, 64, 4, 2, 16, True, "xla")
    assert row["forward_backward_s"] > 0 and row["forward_backward_temp_bytes"] > 0
