"""Plans across processes: 2 processes x 4 CPU devices (jax.distributed, gloo on loopback),
each feeding half of the batch, compute what 1 process x 8 devices computes: one-stage
plans, and a two-stage pipeline with one stage on each process."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import automap as am
from _distributed_worker import (
    DEVICES_PER_PROCESS,
    MODEL,
    PIPELINE,
    PLANS,
    PROCESSES,
    SMALL_PLAN,
    UNEQUAL_PLAN,
    flat,
    train,
)
from automap._groups import build_groups
from automap._pipeline import pipeline_plan, pipeline_schedule
from automap._space import batch_groups, block_groups
from automap._verify import compare_outputs
from automap._zoo import get_model

WORKER = Path(__file__).with_name("_distributed_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(out: Path) -> list[subprocess.Popen]:
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = []
    for i in range(PROCESSES):
        cmd = [sys.executable, str(WORKER), str(i), str(port), str(out)]
        # A file, not a pipe: nobody reads a pipe while the workers run, and a full one blocks.
        with (out / f"log-{i}.txt").open("w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def _wait(procs: list[subprocess.Popen], out: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    failed = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed.append(f"process {i} still running after {TIMEOUT_S} s")
        if p.returncode:
            failed.append(f"process {i} exited with {p.returncode}")
    for p in procs:  # a hung process would hold the port and the CPU for later tests
        if p.poll() is None:
            p.kill()
            p.wait()
    if failed:
        logs = "\n".join(
            f"--- process {i} output ---\n{(out / f'log-{i}.txt').read_text()[-6000:]}"
            for i in range(PROCESSES)
        )
        pytest.fail("; ".join(failed) + "\n" + logs)


def _pipeline_plan(step_fn, args) -> am.Plan:
    """Two stages on data 2 x model 2 each (devices 0-3, then 4-7), 1F1B, 4 microbatches:
    the first layer, then the second, the head and the loss, so that each microbatch's
    [8, 64] activations cross forward and their gradients back."""
    graph = am.capture(step_fn, *args)
    groups = build_groups(graph)
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    second = [op.index for op in graph.ops if op.primitive == "dot_general"][1]
    return pipeline_plan(graph, groups, (second,), {"data": 2, "model": 2}, assignment, 4, "1f1b")


@pytest.mark.slow
def test_two_processes_compute_what_one_process_computes(tmp_path):
    model = get_model("mlp", **MODEL)
    args = model.concrete_args(seed=0)
    plans = am.expert_plans(model.step_fn, *args, cluster=am.Cluster.preset("cpu", devices=8))
    plans[PIPELINE] = _pipeline_plan(model.step_fn, args)
    # Stage 1 on two devices of process 1: its sends cannot pair device to device.
    stage = dataclasses.replace(
        plans[PIPELINE].stages[1], devices=(4, 5), mesh={"data": 1, "model": 2}
    )
    unequal = dataclasses.replace(plans[PIPELINE], stages=(plans[PIPELINE].stages[0], stage))
    unequal.save(tmp_path / f"{UNEQUAL_PLAN}.json")
    for name in (*PLANS, PIPELINE):
        plans[name].save(tmp_path / f"{name}.json")
    small = am.expert_plans(model.step_fn, *args, cluster=am.Cluster.preset("cpu", devices=4))
    small["data_parallel"].save(tmp_path / f"{SMALL_PLAN}.json")

    procs = _start_workers(tmp_path)
    try:  # the reference, 1 process x 8 devices, while the workers start up
        ref = {
            name: train(am.apply(model.step_fn, plans[name]), *args) for name in (*PLANS, PIPELINE)
        }
        want = {name: flat(out) for name, out in ref.items()}
    finally:
        _wait(procs, tmp_path)

    for name in (*PLANS, PIPELINE):
        for i in range(PROCESSES):
            with np.load(tmp_path / f"{name}-{i}.npz") as got:
                got = dict(got)
            ok, err, where = compare_outputs(got, want[name])
            assert ok, f"{name}, process {i}: off by {err:.3g} at {where}"
    # Shards of each pipeline output on process i's devices, in the 1-process run.
    held = [
        {
            jax.tree_util.keystr(p): sum(
                d.id // DEVICES_PER_PROCESS == i for d in x.sharding.device_set
            )
            for p, x in jax.tree_util.tree_flatten_with_path(ref[PIPELINE])[0]
        }
        for i in range(PROCESSES)
    ]
    for i in range(PROCESSES):
        checks = json.loads((tmp_path / f"checks-{i}.json").read_text())
        assert "none of process(es) [1]" in checks.get("mesh", ""), checks
        assert "fed [16, 12] rows" in checks.get("shares", ""), checks
        assert "global batch / 2 = 14 rows each" in checks["shares"]
        # Both ways of feeding a share ran: straight onto this process's devices, and
        # gathered first where the plan replicates the batch over processes.
        assert checks["share_in_process_order"] == {"megatron_dp": True, "megatron": False}
        # The pipeline ran the 1F1B order, and each output lies on its stage's devices
        # only, as on one process: the loss on stage 1 (process 1), the updated
        # parameters where the partition runs the update.
        order = pipeline_schedule("1f1b").global_order(2, 4)
        assert checks["trace"] == [list(u) for u in order]
        assert checks["held"] == held[i], (i, checks["held"])
        assert checks["global_to_stage"] is True
        assert "stages have [4, 2] devices and lie on different processes" in checks["unequal"]
    assert held[0]["['loss']"] == 0 < held[1]["['loss']"] and any(held[0].values())


@pytest.mark.slow  # plans compiled and run
def test_sharded_results_differ_from_a_wrong_step():
    """The comparison the test relies on sees a step that went wrong (one step too many)."""
    model = get_model("mlp", **MODEL)
    args = model.concrete_args(seed=0)
    plan = am.expert_plans(model.step_fn, *args, cluster=am.Cluster.preset("cpu", devices=8))
    step = am.apply(model.step_fn, plan["megatron_dp"])
    once = flat(train(step, *args))
    _, params, opt_state = step(*args)
    twice = flat(train(step, params, opt_state, args[2]))
    assert not compare_outputs(once, twice)[0]
