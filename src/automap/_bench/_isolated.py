"""The planner on one published row's model and cluster, in a fresh Python process.

A published table (Megatron-LM's, MaxText's) names a zoo model with its settings and a
cluster preset; `PlanJob` holds just that, so that a child process can rebuild both and
plan them. The child's peak RSS is then the planner's own, not that of whatever the
parent ran before (other rows, other benchmarks), and its wall time is what `automap plan`
on that row would show. Planning uses abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._api import plan
from .._axes import PIPE
from .._cluster import Cluster
from .._errors import AutomapError
from .._plan import DEFAULT_SCHEDULE, Plan
from .._zoo import ModelSpec, get_model


@dataclasses.dataclass(frozen=True)
class PlanJob:
    """A zoo model with its settings on a cluster preset: what one row plans."""

    model: str  # zoo name, e.g. "gpt-1.3b", "llama-32b"
    settings: Mapping[str, Any]  # the model's `--set` overrides
    cluster: str  # cluster preset, e.g. "a100", "tpu-v5p"
    devices: int
    topology: str = ""  # a TPU slice's chips per dimension, e.g. "4x4x4"; "" for a GPU

    def spec(self) -> ModelSpec:
        return get_model(self.model, **dict(self.settings))

    def cluster_of(self) -> Cluster:
        extra = {"topology": self.topology} if self.topology else {}
        return Cluster.preset(self.cluster, devices=self.devices, **extra)


def train_step(spec: ModelSpec) -> Callable:
    """The row's step as Megatron-LM and MaxText run it: its update in place, so jitted
    with the parameters and optimizer state donated (a step that donates nothing holds
    its new state beside the old at the update, and is priced so: `_cost/_outputs.py`)."""
    import jax

    return jax.jit(spec.step_fn, donate_argnums=(0, 1))


def plan_shape(found: Plan) -> str:
    """A plan in a few words: its mesh, microbatches and schedule, sequence parallelism,
    recomputation policy, flash attention and ZeRO stage."""
    # A one-stage plan's pipe axis of 1 says nothing; its microbatches are accumulation.
    axes = {k: v for k, v in found.mesh.items() if k != PIPE or found.pipelined}
    mesh = " × ".join(f"{k} {v}" for k, v in axes.items())
    extra = [f"{found.microbatches} mb"] if found.microbatches > 1 else []
    extra += [found.schedule] if found.pipelined and found.schedule != DEFAULT_SCHEDULE else []
    extra += ["SP"] if found.sequence_parallel else []
    extra += [f"remat {found.remat_policy}"] if found.remat else []
    extra += ["flash"] if found.attention == "flash" else []
    extra += [f"ZeRO-{found.zero_stage}"] if found.zero_stage else []
    return mesh + (f" ({', '.join(extra)})" if extra else "")


def plan_job(job: PlanJob, budget_s: float, searcher: str = "auto") -> dict[str, Any]:
    """The planner on the job's model and cluster, in this process: its plan, predicted
    step, wall time (capture included) and this process's peak RSS so far."""
    spec = job.spec()
    start = time.perf_counter()
    found = plan(
        train_step(spec),
        *spec.abstract_args(),
        cluster=job.cluster_of(),
        searcher=searcher,
        budget_s=budget_s,
    )
    wall = time.perf_counter() - start
    cost = found.predicted
    return {
        "plan": plan_shape(found),
        "plan_step_s": cost.step_time_s,
        "plan_feasible": bool(cost.feasible),
        "plan_memory_gb": cost.memory_bytes / 1e9,
        "plan_wall_s": wall,
        # The search's counted work (the stage DP's, in ops) and the one-stage variants
        # it priced: what its budget bought, machine-independent.
        "plan_work": found.decisions.get("work"),
        "plan_one_stage_variants": found.decisions.get("one_stage_variants"),
        # ru_maxrss is in KiB on Linux.
        "plan_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }


def plan_isolated(job: PlanJob, budget_s: float, searcher: str = "auto") -> dict[str, Any]:
    """`plan_job` in a fresh Python process. A plain subprocess, not multiprocessing:
    spawning would re-run the caller's main script."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding `automap`
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    payload = {"job": dataclasses.asdict(job), "budget_s": budget_s, "searcher": searcher}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        code = "import sys; from automap._bench import plan_job_main; plan_job_main(sys.argv[1])"
        done = subprocess.run(
            [sys.executable, "-c", code, str(out)],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0 or not out.exists():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise AutomapError(f"the planner failed: {last[0]}")
        return json.loads(out.read_text())


def plan_job_main(out: str) -> None:
    """The child's side of `plan_isolated`: a job as JSON on stdin, `plan_job`'s answer
    as JSON in the file `out`."""
    payload = json.loads(sys.stdin.read())
    found = plan_job(PlanJob(**payload["job"]), payload["budget_s"], payload["searcher"])
    Path(out).write_text(json.dumps(found))


def planner_columns(job: PlanJob, plan_s: float, searcher: str, baseline_s: float, versus: str):
    """A published row's planner columns: the planner's plan in a fresh process
    (`plan_isolated`) with its step over the row's priced configuration's (`baseline_s`)
    under the key `versus`; where it finds none (none fits, say), why, and its wall time."""
    start = time.perf_counter()
    try:
        found = plan_isolated(job, plan_s, searcher)
    except AutomapError as e:
        return {"plan_error": str(e), "plan_wall_s": time.perf_counter() - start}
    return {**found, versus: found["plan_step_s"] / baseline_s}
