"""One of the processes tests/test_distributed.py starts (a script, not a test module).

`python _distributed_worker.py PROCESS_ID PORT DIR` joins a 2-process jax.distributed run
on loopback, 4 CPU devices each with gloo collectives, so the processes form one
8-device mesh. For every plan saved in DIR by the test it trains the zoo MLP for a few
steps, feeding only this process's half of the batch, and writes the outputs, gathered
whole, to DIR/<plan>-<process>.npz; the pipeline plan (two stages, one per process) the
same way. It then checks the refusals (a plan whose mesh leaves out a process, unequal
batch shares) and writes their messages, and what each process held and ran of the
pipeline, to DIR/checks-<process>.json.

The test imports MODEL, PLANS, train and flat from here to compute the 1-process
reference the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

PROCESSES = 2
DEVICES_PER_PROCESS = 4
MODEL = {"layers": 2, "hidden": 64, "batch": 32}
STEPS = 2  # the second step is fed the first one's outputs: global arrays, not host values
# megatron_dp: data 4 x model 2, the batch split over processes in process order;
# zero3: data 8, parameters and Adam moments sharded across both processes;
# megatron: model 8, the batch replicated, so each process needs the other's rows.
PLANS = ("megatron_dp", "zero3", "megatron")
SMALL_PLAN = "data_parallel_4"  # made for 4 devices: its mesh leaves out process 1
# Two stages on data 2 x model 2 each, 1F1B over 4 microbatches: stage 0 on process 0's
# devices, stage 1 on process 1's, so activations and gradients cross processes.
PIPELINE = "pipeline_1f1b"
UNEQUAL_PLAN = "pipeline_4_2"  # its stages have 4 and 2 devices, on different processes


def train(step, params: Any, opt_state: Any, batch: Any) -> dict[str, Any]:
    """STEPS training steps on the same batch; the last loss and the final state."""
    for _ in range(STEPS):
        loss, params, opt_state = step(params, opt_state, batch)
    return {"loss": loss, "params": params, "opt_state": opt_state}


def flat(tree: Any) -> dict[str, np.ndarray]:
    """Leaves by path, as numpy (the form the .npz holds)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def main(process_id: int, port: int, out: Path) -> None:
    # The backend must not start before these are set: they decide its devices.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=PROCESSES,
        process_id=process_id,
        initialization_timeout=120,
    )
    from jax.experimental.multihost_utils import process_allgather
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import automap as am
    from automap._run import move, rows_in_process_order
    from automap._zoo import get_model

    assert jax.device_count() == PROCESSES * DEVICES_PER_PROCESS, jax.devices()
    model = get_model("mlp", **MODEL)
    params, opt_state, batch = jax.tree.map(np.asarray, model.concrete_args(seed=0))
    share = MODEL["batch"] // PROCESSES
    mine = jax.tree.map(lambda x: x[process_id * share : (process_id + 1) * share], batch)

    for name in PLANS:
        step = am.apply(model.step_fn, am.Plan.load(out / f"{name}.json"))
        result = process_allgather(train(step, params, opt_state, mine), tiled=True)
        np.savez(out / f"{name}-{process_id}.npz", **flat(result))

    checks: dict[str, Any] = {"share_in_process_order": {}}
    step = am.apply(model.step_fn, am.Plan.load(out / f"{PIPELINE}.json"))
    result = train(step, params, opt_state, mine)
    np.savez(out / f"{PIPELINE}-{process_id}.npz", **flat(step.gather(result)))
    checks["trace"] = [list(unit) for unit in step.trace]
    # Shards of each output this process's devices hold: those of its own stage only.
    checks["held"] = {
        jax.tree_util.keystr(p): len(x.addressable_shards)
        for p, x in jax.tree_util.tree_flatten_with_path(result)[0]
    }
    # A global array on devices that are no stage's (the batch made as a one-stage plan
    # takes it, over every device) reaches a stage gathered, not sent.
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec("all"))
    x = jax.make_array_from_process_local_data(everywhere, mine["x"])
    on_stage = move(x, NamedSharding(step.meshes[1], PartitionSpec("data")), step.meshes)
    checks["global_to_stage"] = bool(np.array_equal(step.gather(on_stage), batch["x"]))
    try:
        am.apply(model.step_fn, am.Plan.load(out / f"{UNEQUAL_PLAN}.json"))(params, opt_state, mine)
    except am.ApplyError as e:
        checks["unequal"] = str(e)

    # Which way each plan's batch is fed: straight from the share, or gathered first.
    for name in ("megatron_dp", "megatron"):
        plan = am.Plan.load(out / f"{name}.json")
        spec = jax.sharding.PartitionSpec(*plan.specs["[2]['x']"])
        sharding = jax.sharding.NamedSharding(am.apply(model.step_fn, plan).mesh, spec)
        checks["share_in_process_order"][name] = rows_in_process_order(sharding, batch["x"].shape)
    small = am.apply(model.step_fn, am.Plan.load(out / f"{SMALL_PLAN}.json"))
    try:
        small(params, opt_state, mine)
    except am.ApplyError as e:
        checks["mesh"] = str(e)
    # Process 1 feeds 4 rows too few; a fresh apply, so both processes compare shares.
    uneven = jax.tree.map(lambda x: x[: share - 4 * process_id], mine)
    try:
        am.apply(model.step_fn, am.Plan.load(out / f"{PLANS[0]}.json"))(params, opt_state, uneven)
    except am.ApplyError as e:
        checks["shares"] = str(e)
    (out / f"checks-{process_id}.json").write_text(json.dumps(checks))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
