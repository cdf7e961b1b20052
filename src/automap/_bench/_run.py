"""`automap bench`: every zoo model on its preset clusters, every searcher, one markdown file.

Each case is captured once (`Problem.build`) and every searcher plans it under the same
cost model, so the rows differ only in how they search. The exact optimum (ILP, checked by
exhaustive enumeration where the space is small enough) is the yardstick: the DQN, random
and MCMC searchers are reported as a ratio to it and as the time their learning curve took
to come within 1% of it. The cost model's own fidelity (against XLA's compiled HLO) and
speed come from `benchmarks/bench_fidelity.py` and `benchmarks/bench_cost.py`, run as they
are, so the figures here are the ones those scripts print.

Megatron-LM's published table (`_megatron.py`) closes it: Megatron's own configuration of
each row priced, and the planner's plan for the same model and cluster beside it.

The hybrid column is the `dp` searcher's answer with pipelines allowed: its exact stage cuts
over the data × tensor × pipeline space, against the one-stage optimum (the ILP's, run once
for both). The expert column's best includes the pipeline experts (GPipe, Megatron 3-D).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._axes import PIPE
from .._cluster import Cluster
from .._errors import AutomapError
from .._report import human_time
from .._search import Problem, priced_experts, run_searcher
from .._space import ShardSpace
from .._version import __version__
from .._zoo import get_model, list_models
from ._compare import Row, make_row
from ._korthikanti import KORTHIKANTI_TABLE, korthikanti_table
from ._maxtext import MAXTEXT_TABLE, maxtext_table
from ._megatron import MEGATRON_TABLE, megatron_table

EXHAUSTIVE_LIMIT = 200_000  # points: above this only the ILP proves the optimum
WITHIN = 0.01  # "time to 1%": the first moment a curve's best is within this of the optimum
BENCH_SEARCHERS = ("dqn", "random", "mcmc")
BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"  # present in a clone


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    cluster: str
    devices: int
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.cluster} × {self.devices}"


FULL = (
    Case("bert-base", "a100", 8),
    Case("bert-base", "a100", 16),
    Case("bert-large", "a100", 8),
    Case("bert-large", "a100", 16),
    Case("t5-base", "v100", 8),
    Case("t5-large", "a100", 16),
    Case("vgg19", "v100", 8),
    Case("resnet50", "v100", 8),
    Case("moe-gpt", "a100", 16),
    Case("gpt2-xl", "a100", 32),
    Case("gpt-1.3b", "a100", 32),
    Case("gpt-6.7b", "a100", 64),
    Case("gpt-6.7b", "h100", 64),
)
# Small-to-mid models whose capture and search fit a few minutes on two cores.
QUICK = (
    Case("bert-base", "a100", 8),
    Case("t5-base", "v100", 8),
    Case("vgg19", "v100", 8),
    Case("bert-large", "a100", 16),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    budget_s: float
    seeds: int
    fidelity_models: tuple[str, ...]  # names in bench_fidelity.MODELS; () skips the table
    fidelity_plans: int
    speed_model: str | None  # zoo model whose plans/s is measured; None skips it
    command: str
    # The pipeline search's budget: its outer space (stage count × stage mesh × microbatches,
    # an ILP per stage mesh) is larger than one stage's, and it stops where the budget ends.
    dp_budget_s: float = 60.0
    # The published tables (`PUBLISHED`: Megatron-LM's SC'21, Korthikanti et al.'s, MaxText's
    # v5p): None skips them; 0 prices each row's published configuration
    # (about 15 s a row on two cores); > 0 also runs the planner on each row with this
    # budget, in a fresh process (budget + capture + JAX's start).
    megatron_plan_s: float | None = None
    megatron_searcher: str = "auto"


def quick_settings(command: str, budget_s: float = 3.0, seeds: int = 1) -> Settings:
    return Settings(budget_s, seeds, ("mlp", "bert"), 6, "bert-large", command, 15.0)


def full_settings(command: str, budget_s: float = 20.0, seeds: int = 1) -> Settings:
    # The Megatron table with the planner at 30 s a row: about 10 minutes on two cores.
    fidelity = ("mlp", "bert", "gpt", "vgg19")
    return Settings(budget_s, seeds, fidelity, 10, "bert-large", command, 60.0, 30.0)


def select(cases: Sequence[Case], models: Sequence[str] | None) -> tuple[Case, ...]:
    """The cases of `models` (all of `cases` when None); a model outside them gets 8 devices
    of its default cluster, so any zoo model can be benched by name."""
    if not models:
        return tuple(cases)

    infos = {i.name: i for i in list_models()}
    out: list[Case] = []
    for name in models:
        if name not in infos:
            raise AutomapError(f"unknown model {name!r}; choose from {', '.join(infos)}.")
        mine = [c for c in cases if c.model == name] or [c for c in FULL if c.model == name]
        for case in mine or [Case(name, infos[name].default_cluster, 8)]:
            if case not in out:  # by value: the quick and full sets share cases
                out.append(case)
    return tuple(out)


# --- one case --------------------------------------------------------------------------


def _run(problem: Problem, name: str, budget_s: float, seed: int) -> Row:
    return _run_task(problem, name, budget_s, None, seed)


def _run_task(problem: Problem, name: str, budget_s: float, task: str | None, seed: int = 0) -> Row:
    start = time.perf_counter()
    try:
        plan = run_searcher(problem, name, budget_s, seed, task=task)
    except AutomapError as e:
        return Row(name, "", None, None, False, time.perf_counter() - start, None, None, str(e))
    return make_row(name, plan, time.perf_counter() - start)


def within_1pct(row: Row, optimum: float | None) -> tuple[float, int] | None:
    """(seconds, episode or evaluation) when the row's curve first came within 1% of the
    optimum. DQN rows carry elapsed_s; random/MCMC rows count evaluations, timed at the
    search's mean rate (its wall time / evaluations)."""
    if row.plan is None or optimum is None:
        return None
    curve = row.plan.decisions.get("curve") or []
    evaluated = row.plan.decisions.get("evaluated") or len(curve) or 1
    per_eval = row.plan.provenance.search_time_s / evaluated
    best = float("inf")
    for point in curve:
        # The DQN's best_time may be an infeasible plan's before a feasible one is found.
        if "feasible" in point:
            if point["feasible"]:
                best = min(best, point["current_time"])
        else:
            best = point["best_time"]
        if best <= (1 + WITHIN) * optimum:
            seconds = point.get("elapsed_s", point["episode"] * per_eval)
            return float(seconds), int(point["episode"])
    return None


def bench_case(case: Case, s: Settings, step: Callable[[str], None] = lambda _: None) -> dict:
    """Every searcher on one case: the summary the tables show, and every row."""

    step("capture")
    t0 = time.perf_counter()
    spec = get_model(case.model, **case.overrides)
    cluster = Cluster.preset(case.cluster, devices=case.devices)
    problem = Problem.build(spec.step_fn, spec.abstract_args(), cluster)
    capture_s = time.perf_counter() - t0
    size = ShardSpace(problem.graph, problem.groups, cluster, problem.cost_model).size()

    step("experts")
    start = time.perf_counter()
    experts = [
        make_row("expert", p, time.perf_counter() - start) for p in priced_experts(problem).values()
    ]
    rows = list(experts)
    step("ilp")
    ilp = _run(problem, "ilp", max(s.budget_s, 60.0), 0)  # exact: never cut short by a small budget
    rows.append(ilp)
    exhaustive = None
    if size <= EXHAUSTIVE_LIMIT:
        step(f"exhaustive ({size:,} points)")
        # A cross-check must enumerate it all: like the ILP, not cut by a small budget.
        exhaustive = _run(problem, "exhaustive", max(s.budget_s, 600.0), 0)
        rows.append(exhaustive)
    optimum = _optimum(ilp, exhaustive)
    step("dp (pipelines)")
    # The dp searcher's hybrid answer is the faster of the one-stage ILP optimum and its
    # best pipeline: the ILP above is that first half, so only the pipelines run here.
    piped = _run_task(problem, "dp", s.dp_budget_s, "pipeline")
    rows.append(piped)
    hybrid = _hybrid(ilp, piped, optimum)
    searchers: dict[str, list[dict]] = {}
    for name in BENCH_SEARCHERS:
        for seed in range(s.seeds):
            step(f"{name} seed {seed}")
            row = _run(problem, name, s.budget_s, seed)
            rows.append(row)
            searchers.setdefault(name, []).append(_searcher_summary(row, seed, optimum))

    dp = next((r for r in experts if r.plan_name == "data_parallel"), None)
    feasible = [r for r in experts if r.feasible and r.step_time_s is not None]
    best = min(feasible, key=lambda r: r.step_time_s) if feasible else None
    return {
        "model": case.model,
        "cluster": case.cluster,
        "devices": case.devices,
        "overrides": dict(case.overrides),
        "space_points": size,
        "capture_s": round(capture_s, 2),
        "data_parallel_s": dp.step_time_s if dp is not None and dp.feasible else None,
        "best_expert": None
        if best is None
        else {"name": best.plan_name, "time_s": best.step_time_s},
        "optimum": optimum,
        "hybrid": hybrid,
        "searchers": searchers,
        "rows": [{"seed": r.plan.provenance.seed if r.plan else 0, **r.to_dict()} for r in rows],
    }


def _optimum(ilp: Row, exhaustive: Row | None) -> dict | None:
    if ilp.plan is None or ilp.step_time_s is None:
        return None
    stats = ilp.plan.decisions
    proof = (
        "ILP optimal" if stats.get("optimal") else f"ILP, gap {stats.get('gap', float('nan')):.1e}"
    )
    done = exhaustive is not None and exhaustive.plan is not None
    if done and exhaustive.plan.decisions.get("complete", True):
        agree = abs(exhaustive.step_time_s - ilp.step_time_s) <= 1e-9 + 1e-6 * ilp.step_time_s
        proof += (
            ", exhaustive agrees"
            if agree
            else (f", exhaustive finds {human_time(exhaustive.step_time_s)}")
        )
    mesh = " × ".join(f"{k} {v}" for k, v in ilp.plan.mesh.items())
    if ilp.plan.zero_stage:
        mesh += f", ZeRO-{ilp.plan.zero_stage}"
    return {"time_s": ilp.step_time_s, "mesh": mesh, "proof": proof}


def _hybrid(ilp: Row, piped: Row, optimum: dict | None) -> dict | None:
    """The hybrid optimum: the best pipeline when it beats one stage, else the one-stage
    optimum; with its stages, microbatches and mesh, and its ratio to the one-stage one."""
    pipe_ok = piped.plan is not None and piped.feasible and piped.step_time_s is not None
    one_ok = ilp.plan is not None and ilp.feasible and ilp.step_time_s is not None
    if not (pipe_ok or one_ok):
        return None
    use_pipe = pipe_ok and (not one_ok or piped.step_time_s < ilp.step_time_s)
    row = piped if use_pipe else ilp
    plan = row.plan
    stats = piped.plan.decisions if piped.plan is not None else {}
    mesh = " × ".join(f"{k} {v}" for k, v in plan.mesh.items() if k != PIPE)
    if plan.zero_stage:
        mesh += f", ZeRO-{plan.zero_stage}"
    if plan.remat:
        mesh += ", remat"
    opt = optimum["time_s"] if optimum else None
    return {
        "time_s": row.step_time_s,
        "ratio": row.step_time_s / opt if opt else None,
        "stages": max(1, len(plan.stages)),
        "microbatches": plan.microbatches,
        "schedule": plan.schedule if use_pipe else None,
        "mesh": mesh or "one device",  # the stage mesh
        "bubble_s": plan.predicted.bubble_s if plan.predicted else None,
        # The best pipeline found, even when one stage wins: how close it came.
        "pipeline_s": piped.step_time_s if pipe_ok else None,
        "complete": bool(stats.get("complete", False)),
        "points": stats.get("points"),
        "search_s": round(piped.search_time_s, 2),
        "note": piped.note,
    }


def _searcher_summary(row: Row, seed: int, optimum: dict | None) -> dict:
    opt = optimum["time_s"] if optimum else None
    hit = within_1pct(row, opt)
    return {
        "seed": seed,
        "time_s": row.step_time_s if row.feasible else None,
        "ratio": row.step_time_s / opt if row.feasible and opt and row.step_time_s else None,
        "to_1pct_s": None if hit is None else round(hit[0], 3),
        "to_1pct_episode": None if hit is None else hit[1],
        "search_s": round(row.search_time_s, 2),
        # The DQN hands back the best expert plan when it did not beat it.
        "expert_floor": row.plan_name.startswith("dqn ("),
        "note": row.note,
    }


# --- the cost model: fidelity against XLA, speed ----------------------------------------


def fidelity(models: Sequence[str], plans: int) -> list[dict] | str:
    """bench_fidelity.py's rows; it runs in its own process because it needs 8 virtual CPU
    devices, which JAX only grants before its backend starts."""
    script = BENCH_DIR / "bench_fidelity.py"
    if not models:
        return "not run"
    if not script.exists():
        return f"not run: {script} is missing (run from a clone of the repository)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fidelity.json"
        cmd = [sys.executable, str(script), "--plans", str(plans), "--models", *models]
        done = subprocess.run(
            [*cmd, "--json", str(out)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not out.exists():
            return f"failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
        rows = json.loads(out.read_text())
    for r in rows:
        r.pop("cases", None)  # the per-plan corpus belongs to bench_fidelity --json
    return rows


def speed(model: str | None) -> dict | str:
    """bench_cost.py's figures (plans and one-group deltas scored per second) for `model`."""
    script = BENCH_DIR / "bench_cost.py"
    if model is None:
        return "not run"
    if not script.exists():
        return f"not run: {script} is missing (run from a clone of the repository)"
    spec = importlib.util.spec_from_file_location("_automap_bench_cost", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"model": model, **module.bench(model)}


# --- the whole run and its markdown -----------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    memory = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: platform's answer stands
    import jax

    try:
        commit = subprocess.run(
            ["git", "-C", str(BENCH_DIR.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        # Benchmarks of uncommitted code say so: the commit alone would not reproduce them.
        dirty = subprocess.run(
            ["git", "-C", str(BENCH_DIR.parent), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        commit += " (with uncommitted changes)" if commit and dirty else ""
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "automap": __version__,
        "commit": commit or None,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


#: The published tables a bench run prices (and plans, with a budget): its result's key,
#: the table's function and its rows.
PUBLISHED = (
    ("megatron", megatron_table, MEGATRON_TABLE),
    ("korthikanti", korthikanti_table, KORTHIKANTI_TABLE),
    ("maxtext", maxtext_table, MAXTEXT_TABLE),
)


def run_bench(cases: Sequence[Case], s: Settings, progress: bool = True) -> dict:
    """Every case, the fidelity and speed figures, the machine: what BENCHMARKS.md shows."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    results: list[dict] = []
    # capture, experts, ilp, (exhaustive), dp, searches
    steps = 4 + len(BENCH_SEARCHERS) * s.seeds + 2
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        disable=not progress, transient=True,
    ) as bar:  # fmt: skip
        published_steps = sum(len(rows) for *_, rows in PUBLISHED)
        published_steps *= s.megatron_plan_s is not None
        task = bar.add_task("bench", total=len(cases) * steps + 2 + published_steps)
        for case in cases:

            def step(what: str, case: Case = case) -> None:
                text = f"{case.model} {case.label}: {what}"
                bar.update(task, advance=1, description=text)
                if progress and not bar.console.is_terminal:
                    # No live bar in a log file: one line per step shows where a run is.
                    print(f"[{time.perf_counter() - start:6.0f} s] {text}", file=sys.stderr)

            results.append(bench_case(case, s, step))
        bar.update(task, description=f"cost model fidelity against XLA ({s.fidelity_plans} plans)")
        fid = fidelity(s.fidelity_models, s.fidelity_plans)
        bar.update(task, advance=1, description=f"cost model speed ({s.speed_model})")
        spd = speed(s.speed_model)
        skipped = "not run (`automap bench --megatron-plan-s 30` runs it)"
        published: dict[str, dict | str] = {key: skipped for key, *_ in PUBLISHED}
        if s.megatron_plan_s is not None:

            def row_step(what: str) -> None:
                bar.update(task, advance=1, description=what)
                if progress and not bar.console.is_terminal:
                    print(f"[{time.perf_counter() - start:6.0f} s] {what}", file=sys.stderr)

            published = {
                key: table(plan_s=s.megatron_plan_s, searcher=s.megatron_searcher, step=row_step)
                for key, table, _ in PUBLISHED
            }
    return {
        "machine": machine(),
        "command": s.command,
        "settings": dataclasses.asdict(s),
        "wall_s": round(time.perf_counter() - start, 1),
        "cases": results,
        "fidelity": fid,
        "speed": spd,
        **published,
    }
