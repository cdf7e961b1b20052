"""`automap report`: the HTML page, its embedded images, the combined PNG, and that a real
browser (headless Chromium) renders it with no network."""

import base64
import io
import itertools
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image, ImageStat

import automap as am
from automap._errors import AutomapError
from automap._pipeline import Phase
from automap._plan import Provenance
from automap._report import (
    PHASE_COLORS,
    memory_bars,
    mesh_layout,
    pipeline_ops,
    read_curve,
    render_report,
    sharding_rows,
    stage_times,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("mesh", "sharding", "pipeline", "memory", "curve", "step-time", "collectives")


def _layers(n: int, spec_of) -> dict:
    specs = {}
    for i in range(n):
        for name, spec in spec_of(i).items():
            specs[f"[0]['params']['layer_{i}']['{name}']"] = spec
    return specs


def _dp_tp_plan() -> am.Plan:
    specs = _layers(4, lambda i: {"w_in": (None, "model"), "w_out": ("model", None), "b": (None,)})
    specs["[0]['params']['embed']"] = ("model", None)
    specs["[1][0].mu['params']['embed']"] = ("model", None)  # optimizer state: left out
    specs["[2]['tokens']"] = ("data", None)
    cost = am.Cost(
        step_time_s=0.030,
        compute_s=0.022,
        comm_s=0.008,
        bubble_s=0.0,
        memory_bytes=30e9,
        mfu=0.41,
        memory_limit_bytes=72e9,
        memory_breakdown={
            "params": 4e9,
            "grads": 4e9,
            "opt_state": 8e9,
            "activations": 13e9,
            "other": 1e9,
        },
        collectives=(
            am.Collective("all-reduce", "data", 2e9, 1, 0.005),
            am.Collective("all-reduce", "model", 1e8, 16, 0.002),
            am.Collective("all-gather", "model", 5e7, 8, 0.001),
        ),
    )
    return am.Plan(
        mesh={"data": 4, "model": 4},
        specs=specs,
        name="megatron_dp",
        predicted=cost,
        provenance=Provenance(
            searcher="dqn", seed=3, search_time_s=12.5, model="gpt-1.3b", cluster="a100", devices=16
        ),
        decisions={"arg_roles": {"0": "param", "1": "opt_state", "2": "batch"}},
    )


def _pipeline_plan(schedule: str = "1f1b", **decisions) -> am.Plan:
    stages = tuple(
        am.Stage(op_start=10 * s, op_stop=10 * s + 10, devices=(2 * s, 2 * s + 1), mesh={"data": 2})
        for s in range(4)
    )
    cost = am.Cost(0.05, 0.04, 0.002, 0.008, 2e9, 0.3, memory_breakdown={"params": 1e9})
    return am.Plan(
        mesh={"pipe": 4, "data": 2},
        specs=_layers(8, lambda i: {"w": (None, None)}),
        stages=stages,
        microbatches=8,
        schedule=schedule,
        name="pipeline",
        predicted=cost,
        decisions=decisions,
    )


def _write_curve(path: Path) -> Path:
    # The loss column is blank early (no update yet) and epsilon is missing on purpose.
    rows = ["episode,best_time_s,current_time_s,loss"]
    for e in range(1, 41):
        loss = "" if e < 5 else f"{1 / e:.4f}"
        rows.append(f"{e},{0.05 - 0.0005 * min(e, 30):.5f},{0.05 + 0.01 * math.sin(e):.5f},{loss}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _check_page(page: str, n_images: int) -> None:
    assert page.startswith("<!DOCTYPE html>")
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page
    assert page.count('src="data:image/png;base64,') == n_images
    # Offline: no URL at all, and every src/href points into the page itself.
    assert "http://" not in page and "https://" not in page
    assert not re.search(r'(?:src|href)="(?!data:image/png;base64,)', page)
    assert "@import" not in page and "url(" not in page
    for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        raw = base64.b64decode(data)
        assert raw.startswith(PNG_MAGIC)
        Image.open(io.BytesIO(raw)).verify()


def test_data_model_plan_with_curve_found_next_to_the_plan(tmp_path):
    plan_path = _dp_tp_plan().save(tmp_path / "run.json")
    _write_curve(tmp_path / "run.curve.csv")
    out = write_report(plan_path, tmp_path / "report.html", png=tmp_path / "report.png")
    page = out.read_text()
    _check_page(page, n_images=6)  # mesh, sharding, single stage, memory, curve, breakdown
    assert "<title>Auto-MAP plan report — megatron_dp</title>" in page
    assert "40 episodes from run.curve.csv" in page
    assert "gpt-1.3b" in page and "dqn, 3" in page and "No pipeline" in page
    assert "all-gather" in page and "16" in page  # the collectives table
    raw = (tmp_path / "report.png").read_bytes()
    assert raw.startswith(PNG_MAGIC)
    with Image.open(tmp_path / "report.png") as img:
        assert img.width >= 1000 and img.height > img.width


def test_sharding_rows_fold_layers_and_skip_optimizer_state():
    rows = dict(sharding_rows(_dp_tp_plan()))
    assert rows["params/layer_*/w_in  ×4"] == ["", "model"]
    assert rows["params/layer_*/w_out  ×4"] == ["model", ""]
    assert rows["batch: tokens"] == ["data", ""]
    assert not any("mu" in label for label in rows)


def test_sharding_rows_split_a_pattern_whose_layers_differ():
    plan = am.Plan(
        mesh={"model": 2}, specs=_layers(4, lambda i: {"w": ("model" if i < 2 else None,)})
    )
    labels = [label for label, _ in sharding_rows(plan)]
    assert labels == ["params/layer_*/w  ×2  (at 0–1)", "params/layer_*/w  ×2  (at 2–3)"]


def test_plan_without_prediction_still_renders(tmp_path):
    plan = am.Plan(mesh={"data": 8}, specs={"[0]['w']": (None, None), "[1]['x']": ("data",)})
    page = render_report(plan)
    _check_page(page, n_images=2)  # mesh and sharding need no prediction
    assert page.count("no prediction in this plan") >= 4
    assert "no learning curve" in page
    out = write_report(plan, tmp_path / "r.html", png=tmp_path / "r.png")
    assert out.exists() and (tmp_path / "r.png").read_bytes().startswith(PNG_MAGIC)


@pytest.fixture(scope="module")
def pipeline_report(tmp_path_factory):
    """One rendered pipeline page (with a curve found next to its plan), shared by the
    content check and the browser check: rendering is the slow part of these tests."""
    where = tmp_path_factory.mktemp("pipeline")
    plan_path = _pipeline_plan().save(where / "pipe.json")
    _write_curve(where / "pipe.curve.csv")
    return write_report(plan_path, where / "report.html")


def test_pipeline_plan_draws_the_schedule(pipeline_report):
    page = pipeline_report.read_text()
    _check_page(page, n_images=6)  # mesh, sharding, schedule, memory, curve, breakdown
    assert "1F1B: 4 stages × 8 microbatches, 27% idle (simulated from the stage times" in page
    assert "equal shares of the predicted compute" in page


def test_stage_times_from_the_plan_are_used():
    plan = _pipeline_plan(stage_times=[0.003, [0.002, 0.004], 0.006, 0.003])
    times, unit = stage_times(plan)
    assert unit == "ms" and times[1] == (0.002, 0.004)
    assert times[0] == pytest.approx((0.001, 0.002))  # one number: forward 1/3, backward 2/3
    assert stage_times(_pipeline_plan())[0] == [pytest.approx((0.04 / 24, 0.04 / 12))] * 4


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_simulated_schedules_respect_dependencies_and_bubble(schedule):
    s, m, f, b = 4, 8, 1.0, 2.0
    ops = pipeline_ops(s, m, schedule, [(f, b)] * s)
    assert len(ops) == 2 * s * m
    end = {(st, k, mb): e for st, k, mb, _, e in ops}
    for st, kind, mb, start, _ in ops:
        if kind is Phase.FWD and st > 0:
            assert start >= end[(st - 1, Phase.FWD, mb)]
        if kind is Phase.BWD:
            last = start >= end[(st, Phase.FWD, mb)]
            assert start >= end[(st + 1, Phase.BWD, mb)] if st < s - 1 else last
    for st in range(s):  # a stage never runs two things at once
        spans = sorted((a, e) for x, _, _, a, e in ops if x == st)
        assert all(e <= a2 for (_, e), (a2, _) in itertools.pairwise(spans))
    # Equal stages: both schedules take (m + s - 1) slots of forward + backward.
    assert max(e for *_, e in ops) == pytest.approx((m + s - 1) * (f + b))


def test_a_split_backward_has_b_and_w_times():
    """ZB-H1's stages run (forward, B, W): the cost model's triples as given, a backward
    given whole shared equally between B and W, as are the predicted compute's shares."""
    plan = _pipeline_plan(
        "zb-h1", stage_times=[[0.002, 0.003, 0.001], [0.002, 0.004], 0.006, 0.003]
    )
    times, unit = stage_times(plan)
    assert unit == "ms" and times[0] == (0.002, 0.003, 0.001)
    assert times[1] == (0.002, 0.002, 0.002)
    assert times[2] == pytest.approx((0.002, 0.002, 0.002))  # 1/3 forward, 2/3 backward
    assert stage_times(_pipeline_plan("zb-h1"))[0] == [pytest.approx((0.04 / 24,) * 3)] * 4
    ops = pipeline_ops(4, 8, "zb-h1", times)
    w = [(st, e - a) for st, kind, _, a, e in ops if kind is Phase.WGT]
    assert len(w) == 4 * 8 and min(width for _, width in w) > 0
    assert all(width == pytest.approx(times[st][2]) for st, width in w)


def _schedule_png(page: str) -> Image.Image:
    section = page.split('<section id="pipeline">', 1)[1].split("</section>", 1)[0]
    (data,) = re.findall(r'src="data:image/png;base64,([^"]+)"', section)
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def _pixels_near(img: Image.Image, color: str, tolerance: int = 8) -> int:
    want = tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))
    return sum(
        n
        for n, rgb in img.getcolors(img.width * img.height)
        if all(abs(a - b) <= tolerance for a, b in zip(rgb, want, strict=True))
    )


def test_a_zero_bubble_schedule_draws_w_in_its_own_colour():
    """The W units (weight gradients) of ZB-H1 are drawn apart from B, in a colour no
    1F1B drawing has, and the note and legend name B and W."""
    times = [[0.002, 0.002, 0.002]] * 4
    zb = render_report(_pipeline_plan("zb-h1", stage_times=times))
    flat = render_report(_pipeline_plan("1f1b", stage_times=[[0.002, 0.004]] * 4))
    w_color = PHASE_COLORS[Phase.WGT]
    assert w_color not in (PHASE_COLORS[Phase.FWD], PHASE_COLORS[Phase.BWD])
    zb_png, flat_png = _schedule_png(zb), _schedule_png(flat)
    # 32 W bars as wide as the B bars: a large share of the drawing, none in 1F1B's.
    assert _pixels_near(zb_png, w_color) > 0.2 * _pixels_near(zb_png, PHASE_COLORS[Phase.BWD])
    assert _pixels_near(flat_png, w_color) == 0
    assert "ZB-H1: 4 stages × 8 microbatches" in zb
    assert "forward, B (input gradients) and W (weight gradients) of each stage" in zb


def test_curve_reader_tolerates_missing_columns_and_dqn_names(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("best_time,exploration\n0.5,1.0\ninf,0.9\n")
    curve = read_curve(path)
    assert curve["episode"] == [1.0, 2.0]
    assert curve["epsilon"] == [1.0, 0.9] and math.isinf(curve["best_time_s"][1])


def test_a_missing_curve_file_is_a_one_line_error(tmp_path):
    with pytest.raises(AutomapError, match="no learning-curve file"):
        render_report(_dp_tp_plan(), curve=tmp_path / "nope.csv")


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _chromium_flags(tmp_path: Path) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,2000",
    ]


@pytest.mark.skipif(
    _chromium() is None,
    reason="Chromium is not installed (apt-get install -y chromium): the browser check is skipped",
)
def test_report_renders_in_headless_chromium(tmp_path, pipeline_report):
    flags = _chromium_flags(tmp_path)
    url = pipeline_report.resolve().as_uri()
    dom = subprocess.run(
        [_chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<title>Auto-MAP plan report — pipeline</title>" in dom.stdout
    for heading in ("Device mesh", "Pipeline schedule", "Memory per device", "Collectives"):
        assert f"<h2>{heading}</h2>" in dom.stdout
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [_chromium(), *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120
    )
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    with Image.open(shot) as img:
        assert img.size == (1200, 2000)
        variance = ImageStat.Stat(img.convert("L")).var[0]
    assert variance > 0  # not a blank page


def test_mesh_layout_keeps_every_axis_a_direction():
    pos, across, down = mesh_layout({"pipe": 2, "data": 4, "model": 8})
    assert len(set(pos)) == 64
    assert across == "model = 8 within pipe = 2 →" and down == "data = 4 ↓"
    assert pos[1] == (1.0, 0.0) and pos[8] == (0.0, 1.0)  # last axis fastest, as jax lays out
    assert pos[32][0] > pos[7][0] + 1  # the pipe blocks stand apart
    pos, across, _ = mesh_layout({"data": 64})
    assert across == "data = 64, 8 per row →" and pos[9] == (1.0, 1.0)


@pytest.fixture(scope="module")
def dp_plan():
    """A real pipeline plan from the dp searcher: a small gpt on 8 a100s, pipelines only."""
    from automap._zoo import get_model

    spec = get_model("gpt2-xl", layers=4, hidden=64, heads=4, batch=16, seq=16)
    cluster = am.Cluster.preset("a100", devices=8)
    plan = am.plan(
        spec.step_fn,
        *spec.abstract_args(),
        cluster=cluster,
        searcher="dp",
        tasks=("pipeline",),
        budget_s=30,
    )
    assert len(plan.stages) >= 2 and plan.mesh["pipe"] == len(plan.stages)
    return plan


@pytest.mark.slow  # the dp_plan fixture: a stage-DP search
def test_dp_pipeline_plan_report_has_the_pipeline_sections(dp_plan, tmp_path):
    n = len(dp_plan.stages)
    page = write_report(dp_plan, tmp_path / "dp.html").read_text()
    _check_page(page, n_images=5)  # mesh, sharding, schedule, memory, breakdown
    # The schedule is the cost model's, read from the plan, not equal shares.
    assert "plan.decisions[&#x27;stage_times&#x27;]" in page
    assert stage_times(dp_plan)[0] == [tuple(t) for t in dp_plan.decisions["stage_times"]]
    assert f"{n} stages × {dp_plan.microbatches} microbatches" in page
    # The mesh names the pipe axis and the devices of every stage.
    assert "pipe=" in page and "dashed box is one stage" in page
    for s, st in enumerate(dp_plan.stages):
        first, last = min(st.devices), max(st.devices)
        assert f"stage {s}: devices {first}–{last} ({len(st.devices)})" in page
        assert f"<td>[{st.op_start}, {st.op_stop})</td>" in page  # the stages table
        assert f"<th>stage {s}, bytes per device</th>" in page  # one memory column per stage
    assert "specs are on the stage mesh" in page
    # Memory bars per stage against the limit, from plan.decisions["stage_memory"].
    assert [name for name, _ in memory_bars(dp_plan)] == [f"stage {s}" for s in range(n)]


@pytest.mark.slow  # the dp_plan fixture
def test_dp_pipeline_plan_prints_its_stages(dp_plan):
    from rich.console import Console

    from automap._report import print_plan

    console = Console(width=160, record=True)
    print_plan(console, dp_plan, am.Cluster.preset("a100", devices=8))
    text = console.export_text()
    assert f"Pipeline: {len(dp_plan.stages)} stages, {dp_plan.microbatches} microbatches" in text
    assert "bubble" in text and dp_plan.schedule in text
    for st in dp_plan.stages:
        assert f"[{st.op_start}, {st.op_stop})" in text


@pytest.mark.slow  # the dp_plan fixture
@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed: browser check skipped")
def test_dp_pipeline_report_renders_in_headless_chromium(dp_plan, tmp_path):
    page = write_report(dp_plan, tmp_path / "dp.html")
    dom = subprocess.run(
        [_chromium(), *_chromium_flags(tmp_path), "--dump-dom", page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<h2>Pipeline schedule</h2>" in dom.stdout and "<th>ops (forward cut)</th>" in dom.stdout
    assert dom.stdout.count("<img ") == 5
