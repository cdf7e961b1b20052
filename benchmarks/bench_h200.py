"""The cost model against one real H200: whole training steps and the matmuls in them.

Everything else we hold the cost model against is a compiler (XLA's buffer assignment,
its HLO) or a published table. This is the one bench that times real kernels: one-device
plans of zoo models on the `h200` preset, run by `am.apply` on an H200, beside what the
cost model prices for them. Three commands, the first and last on any machine:

    python benchmarks/bench_h200.py predict benchmarks/h200/predicted.json   # CPU, ~1 min
    python benchmarks/bench_h200.py measure benchmarks/h200/predicted.json OUT.json  # GPU
    python benchmarks/bench_h200.py report benchmarks/h200/predicted.json OUT.json

`predict` captures each configuration on abstract shapes, makes its plan
(`am.plan_recipe`, one device) and prices it: step time, its compute split into
matmuls, memory-bound kernels and recomputation, peak memory, and every distinct GEMM
shape the step runs with its priced seconds. The plans go into the file, so the GPU runs
exactly the plan that was priced.

`measure` (on the GPU) times (a) each configuration's step, `am.apply(step, plan)`, the
median of timed steps after warm-up, each configuration in a process of its own so its
peak memory (`memory_stats()["peak_bytes_in_use"]`) is its own, and (b) each distinct
GEMM shape alone, as `jnp.einsum` in the operands' dtype, the median over repeats; and
(c) HBM bandwidth, a large elementwise add. `report` prints them side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (name, zoo model, overrides, recipe keywords): one-device plans that fit an H200.
CONFIGS: tuple[tuple[str, str, dict, dict], ...] = (
    ("gpt-1.3b b8 full", "gpt-1.3b", {"batch": 8}, {"remat": "full"}),
    ("gpt-1.3b b8 selective", "gpt-1.3b", {"batch": 8}, {"remat": "selective"}),
    ("gpt-1.3b b4 none", "gpt-1.3b", {"batch": 4}, {"remat": "none"}),
    ("bert-large b32 none", "bert-large", {"batch": 32}, {"remat": "none"}),
    ("llama 8L b2 full", "llama", {"layers": 8, "batch": 2, "seq": 4096}, {"remat": "full"}),
)
STEPS, WARMUP = 8, 3
# The device is lent by the minute: the GEMMs stop after this many seconds of `measure`.
GEMM_DEADLINE_S = 420
START = time.perf_counter()


def _spec(model: str, overrides: dict):
    from automap._zoo import get_model

    return get_model(model, **overrides)


def predict(path: Path) -> None:
    """Price every configuration on the h200 preset and write the plans and prices."""
    import automap as am
    from automap._bench._isolated import train_step
    from automap._cost._gemm import gemm_shape
    from automap._search import Problem
    from automap._space import Recipe, recipe_plan

    cluster = am.Cluster.preset("h200", devices=1)
    rows = []
    for name, model, overrides, recipe in CONFIGS:
        spec = _spec(model, overrides)
        problem = Problem.build(train_step(spec), spec.abstract_args(), cluster)
        found = recipe_plan(problem.graph, problem.groups, cluster, Recipe(**recipe))
        cost = problem.estimate(found)
        gemms: dict[str, dict] = {}
        matmul = kernels = 0.0
        for i, seconds, _ in cost.per_op:
            op = problem.graph.ops[i]
            shape = gemm_shape(op, problem.graph)
            if shape is None:
                kernels += 0.0 if op.primitive == "dot_general" else seconds
                continue
            matmul += seconds
            dtypes = [str(problem.graph.tensors[t].dtype) for t in op.inputs[:2]]
            key = f"{shape.batch}x{shape.m}x{shape.n}x{shape.k}:{dtypes[0]}:{dtypes[1]}"
            entry = gemms.setdefault(key, {"count": 0, "priced_s": seconds})
            entry["count"] += 1
        rows.append(
            {
                "name": name,
                "model": model,
                "overrides": overrides,
                "recipe": recipe,
                "plan": found.to_dict(),
                "step_s": cost.step_time_s,
                "compute_s": cost.compute_s,
                "matmul_s": matmul,
                "kernels_s": kernels,
                "memory_bytes": cost.memory_bytes,
                "feasible": cost.feasible,
                "gemms": gemms,
            }
        )
        print(f"{name}: {cost.step_time_s:.3f} s, {cost.memory_bytes / 1e9:.1f} GB", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compact: the plans name every parameter of five models.
    path.write_text(json.dumps({"cluster": "h200", "configs": rows}, separators=(",", ":")))


def _timed(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)`, each call waited for."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gemm_seconds(key: str, products: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    dims, left, right = key.split(":")
    batch, m, n, k = (int(x) for x in dims.split("x"))
    # Several products in one program, so that dispatch is not what is timed, each on
    # its own slice of the left operand (a free view), so that XLA cannot merge them.
    a = jnp.ones((products, batch, m, k), left)
    b = jnp.ones((batch, k, n), right)
    run = jax.jit(lambda a, b: [jnp.einsum("bmk,bkn->bmn", a[i], b) for i in range(products)])
    return _timed(run, a, b, repeats=10) / products


def _bandwidth() -> float:
    """Bytes per second of a 4 GiB float32 elementwise add (read two, write one)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2**30,), jnp.float32)
    y = jnp.ones((2**30,), jnp.float32)
    seconds = _timed(jax.jit(lambda x, y: x + y), x, y, repeats=20)
    return 3 * 4 * 2**30 / seconds


def run_step(config: dict, trace_dir: str | None = None, traced: int = 3) -> dict:
    """One configuration's plan run on this process's first device; with `trace_dir`,
    `traced` more steps under `jax.profiler.trace` (perfetto) into it, after the timing."""
    import jax

    import automap as am
    from automap._bench._isolated import train_step

    spec = _spec(config["model"], config["overrides"])
    step = am.apply(train_step(spec), am.Plan.from_dict(config["plan"]))
    args = spec.concrete_args(0)
    start = time.perf_counter()
    state = step(*args)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - start
    for _ in range(WARMUP - 1):
        state = step(state[1], state[2], args[2])  # the step returns (loss, params, opt)
    jax.block_until_ready(state)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        state = step(state[1], state[2], args[2])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    stats = jax.local_devices()[0].memory_stats() or {}
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(traced):
                state = step(state[1], state[2], args[2])
                jax.block_until_ready(state)
    return {
        "step_s": statistics.median(times),
        "steps_s": times,
        "first_call_s": compile_s,
        "peak_bytes": stats.get("peak_bytes_in_use"),
    }


def measure(predicted: Path, out: Path, kernels: bool = True) -> None:
    import jax

    configs = json.loads(predicted.read_text())["configs"]
    result: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    if kernels:
        result["hbm_bytes_per_s"] = _bandwidth()
    out.write_text(json.dumps(result, indent=1))
    result["steps"] = {}
    for index, config in enumerate(configs):
        done = subprocess.run(
            [sys.executable, __file__, "step", str(predicted), str(index)],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"},
        )
        lines = done.stdout.strip().splitlines()
        result["steps"][config["name"]] = (
            json.loads(lines[-1])
            if done.returncode == 0 and lines
            else {"error": done.stderr[-2000:]}
        )
        print(config["name"], result["steps"][config["name"]], flush=True)
        out.write_text(json.dumps(result, indent=1))
    if not kernels:
        return
    gemms = sorted({key for config in configs for key in config["gemms"]})
    result["gemms"] = {}
    for key in gemms:
        if time.perf_counter() - START > GEMM_DEADLINE_S:
            print("out of time for the GEMMs", flush=True)
            break
        try:
            result["gemms"][key] = _gemm_seconds(key)
        except Exception as e:  # one odd shape must not lose the rest
            result["gemms"][key] = None
            print(key, "failed:", e, flush=True)
        out.write_text(json.dumps(result, indent=1))


def report(predicted: Path, measured: Path) -> None:
    from automap import Cluster

    h200 = Cluster.preset("h200", devices=1)
    configs = json.loads(predicted.read_text())["configs"]
    got = json.loads(measured.read_text())
    rate = got["hbm_bytes_per_s"]
    print(f"device: {got['device']}, jax {got['jax']}")
    print(
        f"HBM: {rate / 1e12:.2f} TB/s measured, {rate / h200.hbm_bandwidth:.2f} of the "
        f"preset's {h200.hbm_bandwidth / 1e12:.1f} (priced at memory_efficiency "
        f"{h200.memory_efficiency})"
    )
    print()
    print(
        "| configuration | step priced (s) | step measured (s) | measured / priced "
        "| memory priced (GB) | peak measured (GB) | matmuls priced (s) | "
        "the same GEMMs alone, measured (s) |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for config in configs:
        step = got["steps"].get(config["name"], {})
        alone = [got.get("gemms", {}).get(k) for k in config["gemms"]]
        measured_gemms = (
            sum(got["gemms"][k] * v["count"] for k, v in config["gemms"].items())
            if None not in alone and alone
            else None
        )
        cells = [
            config["name"],
            f"{config['step_s']:.3f}",
            _num(step.get("step_s"), ".3f"),
            _num(step["step_s"] / config["step_s"] if "step_s" in step else None, ".2f"),
            f"{config['memory_bytes'] / 1e9:.1f}",
            _num(step["peak_bytes"] / 1e9 if step.get("peak_bytes") else None, ".1f"),
            f"{config['matmul_s']:.3f}",
            _num(measured_gemms, ".3f"),
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print("| GEMM (batch x M x N x K) | dtypes | priced (ms) | measured (ms) | TFLOP/s measured |")
    print("|---|---|--:|--:|--:|")
    seen: dict[str, float] = {}
    for config in configs:
        for key, entry in config["gemms"].items():
            seen.setdefault(key, entry["priced_s"])
    for key, priced in sorted(seen.items(), key=lambda kv: -kv[1]):
        dims, left, right = key.split(":")
        batch, m, n, k = (int(x) for x in dims.split("x"))
        seconds = got.get("gemms", {}).get(key)
        tflops = 2 * batch * m * n * k / seconds / 1e12 if seconds else None
        print(
            f"| {dims} | {left}, {right} | {priced * 1e3:.3f} | {_num(seconds and seconds * 1e3, '.3f')} "
            f"| {_num(tflops, '.0f')} |"
        )


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def main(argv: list[str]) -> int:
    if argv[:1] == ["predict"]:
        predict(Path(argv[1]))
    elif argv[:1] == ["measure"]:
        measure(Path(argv[1]), Path(argv[2]), kernels="--steps-only" not in argv)
    elif argv[:1] == ["step"]:
        config = json.loads(Path(argv[1]).read_text())["configs"][int(argv[2])]
        print(json.dumps(run_step(config)))
    elif argv[:1] == ["report"]:
        report(Path(argv[1]), Path(argv[2]))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
