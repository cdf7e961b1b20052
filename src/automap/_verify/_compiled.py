"""verify: hold a plan against what XLA really compiles, and against the unsharded step.

The plan is compiled by XLA's SPMD partitioner on a CPU mesh of the plan's shape (or, with
`target`, on compile-only GPUs: `_gpu.py`) with abstract arguments (nothing allocated),
its collectives are read from the HLO text (`_hlo.py`) and compared, kind by kind and axis
by axis, with the cost model's. With concrete small arguments the plan is also run and
compared with `jax.jit(fn)`.

A pipeline plan runs as several programs (per stage and phase, on the stage's devices):
each is compiled as the pipeline runtime compiles it, and their collectives are compared
stage by stage with the pipeline cost model's (`_verify_pipeline`), on the CPU mesh or
on compile-only GPUs alike.

Virtual CPU devices are fixed when JAX starts, so a plan for more devices than this
process has is verified in a fresh Python process (`verify_in_subprocess`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import _errors
from .._capture import capture, rebuild
from .._cluster import Cluster
from .._cost import CostModel, estimate_pipeline
from .._errors import ApplyError, AutomapError
from .._lowering import Lowering
from .._plan import Plan
from .._run import Prepared, apply_pipeline, make_mesh, validate_plan
from ._flops import compiled_flops, predicted_flops, predicted_stage_flops, ratio_note
from ._gpu import gpu_devices
from ._hlo import comm_bytes, parse_collectives
from ._numerics import compare_outputs, reordered
from ._saved import check_saved_plan, reduce_reason
from ._stages import stage_flops, stage_memory_parts

TOLERANCE = 0.05  # a kind@axis matches when its bytes agree within 5%
# A kind@axis moving under 1% of all communication bytes (the larger of the two totals)
# is "trivial": it can be absent from one side without a mismatch. This is what a
# combined scalar loss all-reduce or a tiny bias reshard looks like.
TRIVIAL = 0.01


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The cost model's collectives against XLA's, and numerics against the plain step."""

    mesh: Mapping[str, int]
    # True/False once compared; None when no cost model prediction was available.
    collectives_match: bool | None
    predicted_comm_bytes: Mapping[str, float]  # "kind@axis" -> bytes per device per step
    xla_comm_bytes: Mapping[str, float]
    mismatches: tuple[str, ...] = ()  # one line in words per disagreement
    notes: tuple[str, ...] = ()  # caveats that are not disagreements
    numerics_ok: bool | None = None  # None: no concrete arguments were given
    max_abs_err: float | None = None
    # Peak memory per device: the cost model's, and XLA's buffer assignment of the compiled
    # program (arguments + outputs + temporaries - aliased); None where not compared.
    predicted_memory_bytes: float | None = None
    xla_memory_bytes: float | None = None
    # What each side's peak is made of: the cost model's breakdown ("params", "grads",
    # "opt_state", "activations", "other"), and XLA's ("arguments", "outputs",
    # "temporaries", "aliased"); a pipeline's are its largest stage's.
    predicted_memory_breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    xla_memory_breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # FLOPs per device per step: the cost model's (remat's recompute included), the same
    # counted as XLA counts them (`_flops.py`: loop bodies once, no padded convolution
    # taps), and XLA's `cost_analysis()` ("flops" + "transcendentals"); a pipeline's are
    # its busiest stage's (every program it runs, times its runs).
    predicted_flops: float | None = None
    predicted_flops_as_xla: float | None = None
    xla_flops: float | None = None
    # Pipeline plans, per stage: (predicted, XLA) peak memory per device, and (predicted,
    # as XLA counts, XLA) FLOPs per device per step.
    stage_memory_bytes: tuple[tuple[float | None, float | None], ...] = ()
    stage_flops: tuple[tuple[float, float, float | None], ...] = ()
    # The GPU the plan was compiled for without one ("a100", "h100"); None: a CPU mesh.
    target: str | None = None

    def summary(self) -> str:
        mesh = " × ".join(f"{k}={v}" for k, v in self.mesh.items()) or "one device"
        where = f"compile-only {self.target} GPUs" if self.target else "CPU devices"
        lines = [f"verify: mesh {mesh} ({int(np.prod(list(self.mesh.values())))} {where})"]
        verdict = {True: "match", False: "DO NOT MATCH", None: "not compared (no cost model)"}
        lines.append(
            f"collectives: {verdict[self.collectives_match]} (each kind@axis within "
            f"{TOLERANCE:.0%} in bytes; under {TRIVIAL:.0%} of all traffic is trivial)"
        )
        keys = sorted(set(self.predicted_comm_bytes) | set(self.xla_comm_bytes))
        width = max([len(k) for k in keys] + [9])
        lines.append(f"  {'kind@axis':<{width}}  {'predicted':>12}  {'XLA':>12}")
        for k in keys:
            p, x = self.predicted_comm_bytes.get(k), self.xla_comm_bytes.get(k)
            lines.append(f"  {k:<{width}}  {_fmt(p):>12}  {_fmt(x):>12}")
        lines += [f"  - {m}" for m in self.mismatches]
        lines += [f"  note: {n}" for n in self.notes]
        if self.predicted_memory_bytes is not None and self.xla_memory_bytes:
            ratio = self.predicted_memory_bytes / self.xla_memory_bytes
            lines.append(
                f"memory per device: predicted {_fmt(self.predicted_memory_bytes)}, XLA's "
                f"buffer assignment {_fmt(self.xla_memory_bytes)} ({ratio:.2f}x)"
            )
            for side, parts in (
                ("predicted", self.predicted_memory_breakdown),
                ("XLA", self.xla_memory_breakdown),
            ):
                if parts:
                    text = ", ".join(f"{k} {_fmt(v)}" for k, v in parts.items())
                    lines.append(f"  {side}: {text}")
        if self.xla_flops and self.predicted_flops_as_xla is not None:
            lines.append(
                f"FLOPs per device per step: predicted {self.predicted_flops:.4g}"
                f" ({self.predicted_flops_as_xla:.4g} as XLA counts), XLA's cost analysis "
                f"{self.xla_flops:.4g} ({self.predicted_flops_as_xla / self.xla_flops:.2f}x)"
            )
        for s, ((pm, xm), (pf, pfx, xf)) in enumerate(
            zip(self.stage_memory_bytes, self.stage_flops, strict=True)
        ):
            mem = f"{pm / xm:.2f}x" if pm and xm else "not compared"
            fl = f"{pfx / xf:.2f}x" if xf else "not compared"
            lines.append(
                f"  stage {s}: memory predicted {_fmt(pm)}, XLA {_fmt(xm)} ({mem}); FLOPs "
                f"predicted {pf:.4g} ({pfx:.4g} as XLA counts), XLA {_fmt_flops(xf)} ({fl})"
            )
        if self.numerics_ok is not None:
            ok = "ok" if self.numerics_ok else "DIFFERENT"
            lines.append(f"numerics vs the unsharded step: {ok} (max |err| {self.max_abs_err:.3g})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VerifyReport:
        tuples = {k: tuple(d.get(k, ())) for k in ("mismatches", "notes")}
        for k in ("stage_memory_bytes", "stage_flops"):
            tuples[k] = tuple(tuple(row) for row in d.get(k, ()))
        return cls(**{**d, **tuples})


def _fmt_flops(n: float | None) -> str:
    return "—" if n is None else f"{n:.4g}"


def _fmt(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def compare_collectives(
    predicted: Mapping[str, float], xla: Mapping[str, float]
) -> tuple[bool, list[str]]:
    """Whether every non-trivial kind@axis agrees within TOLERANCE, and why not."""
    total = max(sum(predicted.values()), sum(xla.values()))
    out = []
    for key in sorted(set(predicted) | set(xla)):
        p, x = predicted.get(key, 0.0), xla.get(key, 0.0)
        if max(p, x) < TRIVIAL * total or abs(p - x) <= TOLERANCE * max(p, x):
            continue
        kind, _, axis = key.partition("@")
        if p == 0:
            out.append(f"XLA inserts {kind} over {axis} ({_fmt(x)}) that the cost model misses")
        elif x == 0:
            out.append(f"the cost model predicts {kind} over {axis} ({_fmt(p)}); XLA has none")
        else:
            out.append(f"{kind} over {axis}: predicted {_fmt(p)}, XLA {_fmt(x)} ({p / x - 1:+.1%})")
    return not out, out


def predicted_bytes(graph: Any, plan: Plan, cluster: Any = None) -> dict[str, float]:
    """The cost model's bytes per kind@axis (`Cost.collectives` summed by kind and axis)."""
    return collective_bytes(cpu_model(graph, plan, cluster).estimate(plan))


def collective_bytes(cost: Any) -> dict[str, float]:
    """A Cost's collectives summed by kind@axis."""
    out: dict[str, float] = {}
    for c in cost.collectives:
        key = f"{c.kind}@{c.axis}"
        out[key] = out.get(key, 0.0) + float(c.bytes)
    return out


def predicted_memory(graph: Any, plan: Plan, cluster: Any = None) -> float:
    """The cost model's peak memory per device for the plan."""
    return float(cpu_model(graph, plan, cluster).estimate(plan).memory_bytes)


def cpu_model(graph: Any, plan: Plan, cluster: Any = None) -> CostModel:
    """The cost model of `graph` on `cluster` (default: CPUs) with the CPU's collective
    lowering, where verify compiles (`as_compiled_on_cpu`)."""
    cluster = as_compiled_on_cpu(cluster or Cluster.preset("cpu", devices=plan.devices))
    return CostModel(graph, cluster)


def compiled_memory(compiled: Any) -> float | None:
    """XLA's buffer assignment of a compiled program, per device: arguments + outputs +
    temporaries - the outputs aliased to (donated) arguments; None where the backend does
    not say."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return float(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _donation_note(compiled: Any) -> str:
    """Why XLA's buffer assignment holds the step's outputs apart, when it does: the cost
    model prices them so too (`_cost/_outputs.py`); the note says what donation saves."""
    parts = memory_parts(compiled)
    if not parts or parts["aliased"] or parts["outputs"] < 0.25 * parts["arguments"]:
        return ""
    return (
        f"the step donates no input: XLA holds its outputs ({_fmt(parts['outputs'])}: the "
        "new parameters and optimizer state) apart from its arguments, from the update to "
        "the end of the step, and the cost model prices them so; a step jitted with "
        "donate_argnums (am.apply keeps it) writes them over the old state instead"
    )


def memory_parts(compiled: Any) -> dict[str, float]:
    """XLA's buffer assignment of a compiled program in its parts ({} where the backend
    does not say): `compiled_memory` is arguments + outputs + temporaries - aliased."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {
        "arguments": float(stats.argument_size_in_bytes),
        "outputs": float(stats.output_size_in_bytes),
        "temporaries": float(stats.temp_size_in_bytes),
        "aliased": float(stats.alias_size_in_bytes),
    }


def as_on_cpu(predicted: Mapping[str, float]) -> dict[str, float]:
    """The predicted collectives as XLA's CPU backend lowers them.

    Seen with jax 0.10: the CPU backend never emits reduce-scatter; where a GPU would
    reduce-scatter it all-reduces the whole buffer and slices its shard. Both count the
    whole buffer (docs/DESIGN.md), so a predicted reduce-scatter is compared as an
    all-reduce of the same bytes on the same axis. (`as_compiled_on_cpu` already asks the
    cost model for the CPU's lowering; this fold keeps the comparison right for
    collectives predicted with another.)
    """
    out: dict[str, float] = {}
    for key, nbytes in predicted.items():
        key = key.replace("reduce-scatter@", "all-reduce@")
        out[key] = out.get(key, 0.0) + nbytes
    return out


def as_compiled_on_cpu(cluster: Cluster) -> Cluster:
    """`cluster` with the lowering of XLA's CPU backend (`Lowering.cpu()`), where verify
    compiles.

    Seen with jax 0.10: the CPU backend runs bf16/f16 collectives in f32, never emits
    reduce-scatter, adds a pipeline's running gradient sums outside the matmuls, and
    writes the gradients' all-reduce to a buffer of its own, all-reduces each partial sum
    before adding them, keeps about every residual of the jaxpr and is priced as holding
    every activation and gradient together. The user's cluster (a100, ...) keeps its
    device figures: bytes, not times, are compared.
    """
    return dataclasses.replace(cluster, lowering=Lowering.cpu())


def _cpu_devices(n: int) -> list[Any]:
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise ApplyError(
            f"verify compiles the plan on {n} CPU devices but this process has {len(devices)}. "
            f"Run it in a process started with jax.config.update('jax_num_cpu_devices', {n}) "
            f"(or XLA_FLAGS=--xla_force_host_platform_device_count={n}) before JAX starts, "
            "or save the plan and run `automap verify plan.json` (for a zoo model or an --fn "
            "step), which starts such a process for you."
        )
    return devices


def compile_plan(
    fn: Callable, plan: Plan, args: tuple, graph: Any = None, target: str | None = None
) -> tuple[Prepared, Any]:
    """`fn` under `plan` compiled by XLA on a CPU mesh, or with `target` ("a100", "h100")
    on compile-only GPUs (`_gpu.py`); arguments stay abstract. The executable is kept so
    that a numerics check runs it without compiling twice."""
    devices = gpu_devices(target, plan.devices) if target else _cpu_devices(plan.devices)
    mesh = make_mesh(plan, devices)
    prepared = Prepared(fn, plan, mesh, args, graph=graph)
    return prepared, prepared.jitted.lower(*prepared.abstract_args(args)).compile()


def compiled_text(fn: Callable, plan: Plan, args: tuple) -> str:
    """The partitioned HLO text of `fn` under `plan` (what `_hlo` reads)."""
    return compile_plan(fn, plan, args)[1].as_text()


def verify(
    fn: Callable,
    plan: Plan,
    *args: Any,
    cluster: Any = None,
    target: str | None = None,
) -> VerifyReport:
    """Compile `fn` under `plan` with XLA and compare its collectives with the cost model's.

    `args` may be arrays or ShapeDtypeStructs; when every leaf is a concrete array, the
    plan is also run and its outputs compared with `jax.jit(fn)`'s
    (`_numerics.compare_outputs`: tolerances from the step's structure, its compute
    dtypes and input roles, with Adam's flipped updates allowed on parameters).

    `target` ("a100", "h100"): compile for that GPU without one (`_gpu.py`) and hold the
    program(s) against the cost model of `cluster` (default: the GPU's preset) as it
    prices a GPU, not the CPU's lowering. Nothing runs (no numerics) and XLA's GPU
    compiler reports no FLOPs.
    """
    if plan.pipelined:
        return _verify_pipeline(fn, plan, args, cluster, target)
    validate_plan(plan)

    graph = capture(fn, *args)  # once, for the cost model, constraints and the fingerprint
    prepared, compiled = compile_plan(fn, plan, args, graph=graph, target=target)
    xla = comm_bytes(parse_collectives(compiled.as_text()), plan.mesh)
    model = _held_against(graph, plan, cluster, target)
    cost = model.estimate(plan)
    predicted = collective_bytes(cost)
    match, mismatches = compare_collectives(predicted if target else as_on_cpu(predicted), xla)
    flops, flops_as_xla = predicted_flops(model, plan)
    notes = [n for n in (ratio_note(flops, flops_as_xla), _donation_note(compiled)) if n]
    report = VerifyReport(
        dict(plan.mesh),
        match,
        predicted,
        xla,
        tuple(mismatches),
        notes=tuple(notes),
        predicted_memory_bytes=float(cost.memory_bytes),
        xla_memory_bytes=compiled_memory(compiled),
        predicted_memory_breakdown={k: float(v) for k, v in cost.memory_breakdown.items()},
        xla_memory_breakdown=memory_parts(compiled),
        predicted_flops=flops,
        predicted_flops_as_xla=flops_as_xla,
        xla_flops=compiled_flops(compiled),
        target=target,
    )
    leaves = jax.tree_util.tree_leaves(args)
    if not target and leaves and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        got = compiled(*jax.device_put(_fresh(leaves), prepared.in_shardings))
        ok, err = _numerics(fn, got, args, plan.devices, graph)
        report = dataclasses.replace(report, numerics_ok=ok, max_abs_err=err)
    return report


def _held_against(graph: Any, plan: Plan, cluster: Any, target: str | None) -> CostModel:
    """The cost model a compiled plan is held against: on compile-only GPUs `cluster`
    (default: the GPU's preset) as it prices that GPU, on the CPU mesh the CPU's
    lowering (`cpu_model`)."""
    if target:
        return CostModel(graph, cluster or Cluster.preset(target, devices=plan.devices))
    return cpu_model(graph, plan, cluster)


def _verify_pipeline(
    fn: Callable, plan: Plan, args: tuple, cluster: Any = None, target: str | None = None
) -> VerifyReport:
    """A pipeline plan runs as several XLA programs, not one: per stage its "pre", "F",
    "B" and "post" segments on the stage's sub-mesh, F and B once per microbatch, and
    (with several microbatches) its "reduce" of the gradients once per step. Every
    program one step runs is compiled as the runtime compiles it (`run.compile`: the same
    jitted segments, for the input shardings the step hands them), its collectives read
    on the stage mesh, times its runs per step, and summed per stage and kind@axis; the
    pipeline cost model's per-stage collectives are held against them with the rules of
    one-program plans. Stage-to-stage sends are `jax.device_put`s, not XLA collectives:
    they are left out of both sides. With concrete arguments the pipeline is also run
    and compared with the one-device step. With `target` the programs are compiled for
    that GPU (`_gpu.py`) and held against its cost model; nothing runs."""

    devices = gpu_devices(target, plan.devices) if target else _cpu_devices(plan.devices)
    run = apply_pipeline(fn, plan, devices)
    pipe = run.prepare(*args)  # traces, partitions and checks the plan
    programs = run.compile(*args)
    xla: dict[str, float] = {}
    extra = set()  # programs that are not segments: microbatches joined or summed
    for prog in programs:
        if prog.kind is None:  # the runtime joining microbatches' outputs
            extra.add("concat")
        collectives = parse_collectives(prog.compiled.as_text())
        for key, nbytes in comm_bytes(collectives, prog.mesh).items():
            key = _on_stage(key, prog.stage)
            xla[key] = xla.get(key, 0.0) + nbytes * prog.runs
    model = _held_against(pipe.graph, plan, cluster, target)
    pc = estimate_pipeline(model, plan)
    predicted = _pipeline_predicted(pc)
    stages = range(len(plan.stages))
    held = run.memory(*args)  # the same abstract walk as run.compile: compiled once
    memory = tuple((float(pc.stage_memory_bytes[s]), float(held[s])) for s in stages)
    largest = max(stages, key=lambda s: memory[s][0])
    parts = stage_memory_parts(pipe, programs, largest, pc.in_flight[largest])
    if parts and memory[largest][1] > sum(parts.values()):
        # The values run.memory holds that no program's buffer assignment has: an
        # activation sent on until its receiver has it, a per-step value a later
        # program reads.
        parts["held between programs"] = memory[largest][1] - sum(parts.values())
    match, mismatches = compare_collectives(predicted if target else as_on_cpu(predicted), xla)
    notes = [
        f"pipeline plan ({len(plan.stages)} stages, {plan.microbatches} microbatches, "
        f"{plan.schedule}): each stage's programs are compiled on its sub-mesh and their "
        "collectives summed over one step, per stage; the point-to-point sends between "
        "stages are jax.device_put copies, not XLA collectives, and are not compared",
        "pipeline memory per stage: XLA's side is the largest, over the programs the stage "
        "runs, of that program's buffer assignment plus every other value the runtime "
        "holds on the stage's devices then (run.memory); the breakdowns are those of the "
        f"stage predicted largest ({largest}), XLA's its program sizes combined as "
        "automap._verify._stages says and what run.memory holds besides",
    ]
    if extra:
        notes.append(
            "the runtime also combines microbatches in programs of its own "
            f"({', '.join(sorted(extra))}): their collectives are on XLA's side only"
        )
    flops = tuple(
        (*counted, stage_flops(programs, s))
        for s, counted in enumerate(predicted_stage_flops(model, plan))
    )
    busiest = max(stages, key=lambda s: flops[s][0])
    report = VerifyReport(
        dict(plan.mesh),
        match,
        predicted,
        xla,
        tuple(mismatches),
        tuple(notes),
        predicted_memory_bytes=max(m[0] for m in memory),
        xla_memory_bytes=None if any(m[1] is None for m in memory) else max(m[1] for m in memory),
        predicted_memory_breakdown={k: float(v) for k, v in pc.stage_memory[largest].items()},
        xla_memory_breakdown=parts,
        predicted_flops=flops[busiest][0],
        predicted_flops_as_xla=flops[busiest][1],
        xla_flops=flops[busiest][2],
        stage_memory_bytes=memory,
        stage_flops=flops,
        target=target,
    )
    leaves = jax.tree_util.tree_leaves(args)
    if not target and leaves and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        ok, err = _numerics(fn, run(*_fresh(args)), args, plan.devices, pipe.graph)
        report = dataclasses.replace(report, numerics_ok=ok, max_abs_err=err)
    return report


def _on_stage(key: str, stage: int) -> str:
    """A kind@axis of one pipeline stage: its devices are not the other stages'."""
    return f"{key} (stage {stage})"


def _pipeline_predicted(pc: Any) -> dict[str, float]:
    """The pipeline cost model's collectives per stage and kind@axis, sends left out."""
    out: dict[str, float] = {}
    for s, collectives in enumerate(pc.stage_collectives):
        for c in collectives:
            key = _on_stage(f"{c.kind}@{c.axis}", s)
            out[key] = out.get(key, 0.0) + float(c.bytes)
    return out


def _fresh(tree: Any) -> Any:
    """Host copies of concrete arguments: every run gets buffers of its own, so that a
    step that donates its inputs (a training loop's) leaves the caller's arguments, which
    the next run and the comparison read, as they were."""
    return jax.tree_util.tree_map(_host_copy, tree)


def _host_copy(leaf: Any) -> Any:
    """A copy of one argument leaf; a typed PRNG key (`jax.random.key`) has no NumPy form:
    its key data is copied and wrapped again in the same generator."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = np.array(jax.random.key_data(leaf))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    return np.array(leaf)


def _numerics(fn: Callable, got: Any, args: tuple, devices: int, graph: Any) -> tuple[bool, float]:
    """`got` against the unsharded step (`_numerics.compare_outputs`, with the captured
    step's roles and compute dtypes), no tighter than the noise of summing in another
    order (the step once more on the plan's devices, inputs split: `reordered`)."""
    cpus = jax.devices("cpu")
    want = jax.jit(fn)(*jax.device_put(_fresh(args), cpus[0]))  # one device, unsharded
    noise = reordered(fn, _fresh(args), cpus[: max(devices, 2)])
    verdict = compare_outputs(got, want, graph=graph, before=args, noise=noise)
    return verdict.equal, verdict.max_abs_err


def verify_in_subprocess(
    plan: Plan | str | Path,
    *,
    cluster: Any = None,
    concrete: bool = False,
    timeout: float | None = None,
    target: str | None = None,
) -> VerifyReport:
    """`verify` in a fresh Python with as many virtual CPU devices as the plan needs.

    The step is rebuilt from the plan's provenance (a zoo model or a `--fn` target);
    `concrete=True` also runs the numerics check on random or seeded arguments; `target`
    compiles for that GPU instead (`verify`'s).
    """
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    n = max(plan.devices, 1)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = plan.save(Path(tmp) / "plan.json")
        # `-c`, not `-m`: the module may already be imported by the package's __init__.
        child = (
            "import sys; from automap._verify import subprocess_main; subprocess_main(sys.argv[1:])"
        )
        cmd = [sys.executable, "-c", child, str(plan_path)]
        if cluster is not None:
            (Path(tmp) / "cluster.json").write_text(json.dumps(cluster.to_dict()))
            cmd += ["--cluster", str(Path(tmp) / "cluster.json")]
        cmd += ["--concrete"] if concrete else []
        cmd += ["--target", target] if target else []
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        env = {
            **os.environ,
            "XLA_FLAGS": flags.strip(),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(n),
        }
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            result = json.loads(line[len(_MARK) :])
            if "error" in result:
                raise getattr(_errors, result["type"], AutomapError)(result["error"])
            return VerifyReport.from_dict(result)
    if proc.returncode < 0:  # killed by a signal: its stderr is empty or cut off
        name = signal.Signals(-proc.returncode).name
        why = " (out of memory?)" if name == "SIGKILL" else ""
        raise AutomapError(
            f"verify in a subprocess was killed by {name}{why}: verify the plan without "
            "--numerics, or on a machine with more memory."
        )
    raise AutomapError(
        f"verify in a subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )


_MARK = "AUTOMAP-VERIFY-REPORT "


def _with_reduced_numerics(report: VerifyReport, plan: Plan) -> VerifyReport:
    """`report` with the numbers of `plan`'s pattern on a reduced variant of its model."""
    check = check_saved_plan(plan)
    if not check.get("checked", True):
        return dataclasses.replace(report, notes=(*report.notes, check["reason"]))
    note = f"numerics on a reduced variant ({check['reason']}): " + ", ".join(
        f"{k}={v}" for k, v in check["overrides"].items()
    )
    return dataclasses.replace(
        report,
        numerics_ok=bool(check["equal"]),
        max_abs_err=float(check["max_abs_err"]),
        notes=(*report.notes, note),
    )


def subprocess_main(argv: list[str]) -> None:
    """Child side of verify_in_subprocess: one JSON line on stdout, errors included."""

    try:
        plan = Plan.load(argv[0])
        cluster = (
            Cluster.from_file(argv[argv.index("--cluster") + 1]) if "--cluster" in argv else None
        )
        target = argv[argv.index("--target") + 1] if "--target" in argv else None
        concrete = "--concrete" in argv
        fn, args, _ = rebuild(plan.provenance, abstract=True)
        if concrete and reduce_reason(plan, args, plan.devices):
            # Too big to run here: XLA's collectives on the full-size program, the numbers
            # on a reduced variant, as `apply --check` does.
            report = verify(fn, plan, *args, cluster=cluster, target=target)
            result = _with_reduced_numerics(report, plan).to_dict()
        else:
            fn, args, _ = rebuild(plan.provenance, abstract=not concrete)
            result = verify(fn, plan, *args, cluster=cluster, target=target).to_dict()
    except AutomapError as e:
        result = {"error": str(e), "type": type(e).__name__}
    print(_MARK + json.dumps(result))
