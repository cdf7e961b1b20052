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

The comparison's rules are `_compare.py`'s, the report `_report.py`'s; a plan for more
devices than this process has is verified in a fresh Python process (`_subprocess.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._capture import capture
from .._cost import estimate_pipeline
from .._errors import ApplyError
from .._plan import Plan
from .._run import (
    Prepared,
    apply_pipeline,
    hbm_options,
    input_formats,
    make_mesh,
    out_of_hbm,
    validate_plan,
)
from ._compare import (
    as_on_cpu,
    collective_bytes,
    compare_collectives,
    compiled_memory,
    fmt_bytes,
    held_against,
    live_peak,
    memory_parts,
    on_stage,
    pipeline_predicted,
)
from ._flops import compiled_flops, predicted_flops, predicted_stage_flops, ratio_note
from ._gpu import gpu_devices
from ._hlo import comm_bytes
from ._numerics import compare_outputs, reordered
from ._report import VerifyReport
from ._schedule import overlapped_bytes, scheduled_collectives
from ._stages import stage_flops, stage_memory_parts
from ._tpu import is_tpu_target, tpu_devices


def _donation_note(compiled: Any) -> str:
    """Why XLA's buffer assignment holds the step's outputs apart, when it does: the cost
    model prices them so too (`_cost/_outputs.py`); the note says what donation saves."""
    parts = memory_parts(compiled)
    if not parts or parts["aliased"] or parts["outputs"] < 0.25 * parts["arguments"]:
        return ""
    return (
        f"the step donates no input: XLA holds its outputs ({fmt_bytes(parts['outputs'])}: the "
        "new parameters and optimizer state) apart from its arguments, from the update to "
        "the end of the step, and the cost model prices them so; a step jitted with "
        "donate_argnums (am.apply keeps it) writes them over the old state instead"
    )


def _overlap_note(overlapped: dict[str, float]) -> str:
    """Where XLA's schedule runs compute while a collective is in flight (`_schedule.py`):
    the cost model charges every collective in full on the critical path (DESIGN.md,
    "Collectives overlapped with compute")."""
    if not overlapped:
        return ""
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(overlapped.items()))
    return (
        f"XLA's schedule runs compute between the start and done of some collectives ({parts}); "
        "the cost model charges every collective in full on the critical path, so its "
        "step time is an upper bound there"
    )


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


def _devices(plan: Plan, target: str | None) -> list[Any]:
    """The devices verify compiles the plan for: CPUs, compile-only GPUs ("a100") or the
    compile-only chips of a TPU topology ("v5p:4x4x4", laid as JAX lays a mesh on it)."""
    if not target:
        return _cpu_devices(plan.devices)
    if is_tpu_target(target):
        return tpu_devices(target, tuple(plan.mesh.values()) or (1,))
    return gpu_devices(target, plan.devices)


def compile_plan(
    fn: Callable,
    plan: Plan,
    args: tuple,
    graph: Any = None,
    target: str | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[Prepared, Any]:
    """`fn` under `plan` compiled by XLA on a CPU mesh, or with `target` (a GPU's name)
    on compile-only GPUs (`_gpu.py`); arguments stay abstract. The executable is kept so
    that a numerics check runs it without compiling twice. `options`: XLA debug options
    for this compile alone (`{"xla_gpu_enable_triton_gemm": False}` where XLA's Triton
    GEMM finds no tiling for a matmul)."""
    mesh = make_mesh(plan, _devices(plan, target))
    prepared = Prepared(fn, plan, mesh, args, graph=graph)
    return prepared, prepared.compile(args, options)


def compiled_text(fn: Callable, plan: Plan, args: tuple) -> str:
    """The partitioned HLO text of `fn` under `plan` (what `_hlo` reads)."""
    return compile_plan(fn, plan, args)[1].as_text()


def verify(
    fn: Callable,
    plan: Plan,
    *args: Any,
    cluster: Any = None,
    target: str | None = None,
    compiled: tuple[Prepared, Any] | None = None,
    hbm_bytes: float | None = None,
) -> VerifyReport:
    """Compile `fn` under `plan` with XLA and compare its collectives with the cost model's.

    `args` may be arrays or ShapeDtypeStructs; when every leaf is a concrete array, the
    plan is also run and its outputs compared with `jax.jit(fn)`'s
    (`_numerics.compare_outputs`: tolerances from the step's structure, its compute
    dtypes and input roles, with Adam's flipped updates allowed on parameters).

    `target` ("a100", "h100", "h200"): compile for that GPU without one (`_gpu.py`) and
    hold the program(s) against the cost model of `cluster` (default: the GPU's preset) as it
    prices a GPU, not the CPU's lowering. Nothing runs (no numerics) and XLA's GPU
    compiler reports no FLOPs.

    `compiled`: what `compile_plan(fn, plan, args, target=target)` returned, for a caller
    that compiled the plan to read its program: verify reads that executable rather than
    compiling the same program again (a large model compiled for a GPU or TPU takes
    tens of seconds). One-program plans only: a pipeline's programs are its runtime's.

    `hbm_bytes` (a TPU target): compile as if each chip had that much HBM
    (`_run/_hbm.py`; a pipeline stage's programs each within what the stage holds beside
    it leaves); where XLA cannot fit the plan there, `CompiledOutOfMemoryError`.
    """
    _check_hbm(plan, target, compiled, hbm_bytes)
    if plan.pipelined:
        if compiled is not None:
            raise ApplyError(
                "verify(compiled=...) takes one program, but a pipeline plan runs several: "
                "call verify without it and it compiles each stage's programs"
            )
        return _verify_pipeline(fn, plan, args, cluster, target, hbm_bytes)
    validate_plan(plan)

    graph = capture(fn, *args)  # once, for the cost model, constraints and the fingerprint
    if compiled is None:
        compiled = _compile_within(fn, plan, args, graph, target, hbm_bytes)
    else:
        _check_compiled(compiled, plan, target)
    compiled = compiled[1]
    scheduled = scheduled_collectives(compiled.as_text())
    xla = comm_bytes([s.collective for s in scheduled], plan.mesh)
    overlapped = {k: v for k, (v, _) in overlapped_bytes(scheduled, plan.mesh).items() if v}
    model = held_against(graph, plan, cluster, target)
    cost = model.estimate(plan)
    predicted = collective_bytes(cost)
    match, mismatches = compare_collectives(predicted if target else as_on_cpu(predicted), xla)
    flops, flops_as_xla = predicted_flops(model, plan)
    notes = [ratio_note(flops, flops_as_xla), _donation_note(compiled), _overlap_note(overlapped)]
    notes = [n for n in notes if n] + ([_hbm_note(hbm_bytes)] if hbm_bytes else [])
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
        xla_live_peak_bytes=live_peak(compiled, target),
        predicted_flops=flops,
        predicted_flops_as_xla=flops_as_xla,
        xla_flops=compiled_flops(compiled),
        target=target,
        xla_overlapped_bytes=overlapped,
    )
    leaves = jax.tree_util.tree_leaves(args)
    if not target and leaves and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        got = compiled(*jax.device_put(_fresh(leaves), input_formats(compiled)))
        ok, err = _numerics(fn, got, args, plan.devices, graph)
        report = dataclasses.replace(report, numerics_ok=ok, max_abs_err=err)
    return report


def _check_hbm(plan: Plan, target: str | None, compiled: Any, hbm_bytes: float | None) -> None:
    """`hbm_bytes`, where given, is a TPU compile's, of the program(s) verify compiles
    itself: with a whole chip free XLA's scheduler spends it on overlap, as it cannot for
    a plan that fills the chip, and XLA's own rematerialization is turned off."""
    if hbm_bytes is None:
        return
    if not is_tpu_target(target):
        raise ApplyError(
            f"verify(hbm_bytes=...) limits what XLA's TPU compiler may use: give a TPU "
            f"target (e.g. target='v5p:4x4x4'), not {target!r}"
        )
    if compiled is not None:
        raise ApplyError(
            "verify(hbm_bytes=...) compiles the plan under the limit itself: not with "
            "compiled=... (drop it, or the limit)"
        )


def _compile_within(fn, plan, args, graph, target, hbm_bytes) -> tuple[Prepared, Any]:
    """`compile_plan`, under `hbm_bytes` a chip where given (`_hbm.py`)."""
    options = None if hbm_bytes is None else hbm_options(hbm_bytes)
    try:
        return compile_plan(fn, plan, args, graph, target, options=options)
    except Exception as e:
        short = None if hbm_bytes is None else out_of_hbm(e, hbm_bytes)
        if short is None:
            raise
        raise short from None


def _hbm_note(hbm_bytes: float) -> str:
    return (
        f"compiled as if each chip had {hbm_bytes / 2**20:.1f} MiB of HBM, XLA's own "
        "rematerialization off: its scheduler holds each program within that (a pipeline "
        "stage's, within what the stage holds beside it leaves)"
    )


def _check_compiled(compiled: Any, plan: Plan, target: str | None) -> None:
    """A `compiled` handed to verify is `compile_plan`'s pair, for the plan's mesh and on
    the target's devices (CPUs without one): else one line saying so."""
    prepared = compiled[0] if isinstance(compiled, tuple) and len(compiled) == 2 else None
    if not isinstance(prepared, Prepared):
        raise ApplyError(
            f"verify(compiled=...) takes the (prepared, executable) pair compile_plan "
            f"returns, not {type(compiled).__name__}"
        )
    for sharding in prepared.in_shardings[:1]:  # one mesh carries every argument
        mesh = sharding.mesh
        devices = list(mesh.devices.flat)
        # The mesh `apply` lays the plan on (a plan with no axes: one device, axis "_").
        want = dict(make_mesh(plan, devices).shape) if len(devices) >= plan.devices else None
        on_cpu = devices[0].platform == "cpu"
        if dict(mesh.shape) != want or on_cpu != (not target):
            where = f"target {target!r}" if target else "the CPU"
            raise ApplyError(
                f"verify(compiled=...) was compiled for a mesh {dict(mesh.shape)} on "
                f"{devices[0].platform}, not for this plan's {dict(plan.mesh)} on "
                f"{where}: pass what compile_plan(fn, plan, args, target=target) returned"
            )


def _verify_pipeline(
    fn: Callable,
    plan: Plan,
    args: tuple,
    cluster: Any = None,
    target: str | None = None,
    hbm: float | None = None,
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
    that GPU (`_gpu.py`) and held against its cost model; nothing runs. `hbm`: each TPU
    chip's HBM, each program compiled within what its stage holds beside it leaves."""

    run = apply_pipeline(fn, plan, _devices(plan, target))
    pipe = run.prepare(*args)  # traces, partitions and checks the plan
    programs = run.compile(*args, hbm=hbm)
    xla: dict[str, float] = {}
    overlapped: dict[str, float] = {}  # of those, what compute overlaps (`_schedule.py`)
    extra = set()  # programs that are not segments: microbatches joined or summed
    for prog in programs:
        if prog.kind is None:  # the runtime joining microbatches' outputs
            extra.add("concat")
        scheduled = scheduled_collectives(prog.compiled.as_text())
        for key, nbytes in comm_bytes([c.collective for c in scheduled], prog.mesh).items():
            key = on_stage(key, prog.stage)
            xla[key] = xla.get(key, 0.0) + nbytes * prog.runs
        for key, (hidden, _) in overlapped_bytes(scheduled, prog.mesh).items():
            if hidden:
                key = on_stage(key, prog.stage)
                overlapped[key] = overlapped.get(key, 0.0) + hidden * prog.runs
    model = held_against(pipe.graph, plan, cluster, target)
    pc = estimate_pipeline(model, plan)
    predicted = pipeline_predicted(pc)
    stages = range(len(plan.stages))
    held = run.memory(*args, hbm=hbm)  # the same abstract walk as run.compile: compiled once
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
    if overlapped:
        notes.append(_overlap_note(overlapped))
    if hbm:
        notes.append(_hbm_note(hbm))
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
        xla_live_peak_bytes=max(run.memory(*args, live=True, hbm=hbm))
        if is_tpu_target(target)
        else None,
        predicted_memory_breakdown={k: float(v) for k, v in pc.stage_memory[largest].items()},
        xla_memory_breakdown=parts,
        predicted_flops=flops[busiest][0],
        predicted_flops_as_xla=flops[busiest][1],
        xla_flops=flops[busiest][2],
        stage_memory_bytes=memory,
        stage_flops=flops,
        target=target,
        xla_overlapped_bytes=overlapped,
    )
    leaves = jax.tree_util.tree_leaves(args)
    if not target and leaves and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        ok, err = _numerics(fn, run(*_fresh(args)), args, plan.devices, pipe.graph)
        report = dataclasses.replace(report, numerics_ok=ok, max_abs_err=err)
    return report


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
