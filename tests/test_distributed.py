"""Plans across processes: 2 processes x 4 CPU devices (jax.distributed, gloo on loopback),
each feeding half of the batch, compute what 1 process x 8 devices computes."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import automap as am
from _distributed_worker import MODEL, PLANS, PROCESSES, SMALL_PLAN, flat, train
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


@pytest.mark.slow
def test_two_processes_compute_what_one_process_computes(tmp_path):
    model = get_model("mlp", **MODEL)
    args = model.concrete_args(seed=0)
    plans = am.expert_plans(model.step_fn, *args, cluster=am.Cluster.preset("cpu", devices=8))
    for name in PLANS:
        plans[name].save(tmp_path / f"{name}.json")
    small = am.expert_plans(model.step_fn, *args, cluster=am.Cluster.preset("cpu", devices=4))
    small["data_parallel"].save(tmp_path / f"{SMALL_PLAN}.json")

    procs = _start_workers(tmp_path)
    try:  # the reference, 1 process x 8 devices, while the workers start up
        want = {name: flat(train(am.apply(model.step_fn, plans[name]), *args)) for name in PLANS}
    finally:
        _wait(procs, tmp_path)

    for name in PLANS:
        for i in range(PROCESSES):
            with np.load(tmp_path / f"{name}-{i}.npz") as got:
                got = dict(got)
            ok, err, where = compare_outputs(got, want[name])
            assert ok, f"{name}, process {i}: off by {err:.3g} at {where}"
    for i in range(PROCESSES):
        checks = json.loads((tmp_path / f"checks-{i}.json").read_text())
        assert "none of process(es) [1]" in checks.get("mesh", ""), checks
        assert "fed [16, 12] rows" in checks.get("shares", ""), checks
        assert "global batch / 2 = 14 rows each" in checks["shares"]
        # Both ways of feeding a share ran: straight onto this process's devices, and
        # gathered first where the plan replicates the batch over processes.
        assert checks["share_in_process_order"] == {"megatron_dp": True, "megatron": False}


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
