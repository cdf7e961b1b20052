"""The comparison verify makes: the cost model's collectives and memory next to what the
compiled programs hold.

Collectives are compared kind by kind and axis by axis ("kind@axis", bytes per device per
step, `_hlo.comm_bytes`), within TOLERANCE, trivial ones aside; a pipeline's per stage
(`on_stage`). The cost model is the one a compiled plan is held against (`held_against`):
on the CPU mesh it prices the CPU backend's lowering (`as_compiled_on_cpu`), so bytes, not
times, are compared. Kept apart from the compiling (`_compiled.py`) so the rules of a
match read in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._cluster import Cluster
from .._cost import CostModel
from .._lowering import Lowering
from .._plan import Plan
from ._tpu import is_tpu_target, target_cluster

TOLERANCE = 0.05  # a kind@axis matches when its bytes agree within 5%
# A kind@axis moving under 1% of all communication bytes (the larger of the two totals)
# is "trivial": it can be absent from one side without a mismatch. This is what a
# combined scalar loss all-reduce or a tiny bias reshard looks like.
TRIVIAL = 0.01


def fmt_bytes(n: float | None) -> str:
    """Bytes in words (GiB, MiB, KiB or B), as mismatches and the report print them."""
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
            out.append(
                f"XLA inserts {kind} over {axis} ({fmt_bytes(x)}) that the cost model misses"
            )
        elif x == 0:
            out.append(f"the cost model predicts {kind} over {axis} ({fmt_bytes(p)}); XLA has none")
        else:
            out.append(
                f"{kind} over {axis}: predicted {fmt_bytes(p)}, XLA {fmt_bytes(x)} ({p / x - 1:+.1%})"
            )
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


def live_peak(compiled: Any, target: str | None) -> float | None:
    """libtpu's figure of the most bytes the program holds at once (`peak_memory_in_bytes`);
    None off a TPU target, where the field means otherwise or is not given. Read on
    compile-only v5p chips (libtpu 0.0.42.1, `tests/test_verify_tpu.py`): the arguments,
    the outputs (a step's are its donated arguments, counted once) and the temporaries
    alive at the busiest step of whichever of the chip's two memories holds more of them:
    HBM's on a large program; on a small one, where XLA's memory-space assignment moves
    values out of HBM into the chip's VMEM (47 MiB at most on the TPU fidelity bench's
    plans), VMEM's, though HBM then holds fewer. So it is at least what HBM holds alive
    at once, and the larger of the two memories' figures, not their sum. The temporaries
    `compiled_memory` counts are HBM's allocation, with the gaps its placement leaves
    between buffers (docs/DESIGN.md, "TPU slices"); the cost model prices neither memory
    apart."""
    if not is_tpu_target(target):
        return None
    stats = compiled.memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0) if stats is not None else 0
    return float(peak) if peak else None


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


def held_against(graph: Any, plan: Plan, cluster: Any, target: str | None) -> CostModel:
    """The cost model a compiled plan is held against: on compile-only GPUs `cluster`
    (default: the GPU's preset) as it prices that GPU, on the CPU mesh the CPU's
    lowering (`cpu_model`)."""
    if target:
        return CostModel(graph, cluster or target_cluster(target, plan.devices))
    return cpu_model(graph, plan, cluster)


def on_stage(key: str, stage: int) -> str:
    """A kind@axis of one pipeline stage: its devices are not the other stages'."""
    return f"{key} (stage {stage})"


def pipeline_predicted(pc: Any) -> dict[str, float]:
    """The pipeline cost model's collectives per stage and kind@axis, sends left out."""
    out: dict[str, float] = {}
    for s, collectives in enumerate(pc.stage_collectives):
        for c in collectives:
            key = on_stage(f"{c.kind}@{c.axis}", s)
            out[key] = out.get(key, 0.0) + float(c.bytes)
    return out
