"""Text views for the CLI: Rich tables of models, captures, plans and checks."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._graph import Graph, Role
from .._plan import Plan
from ._data import stage_rows
from ._format import human_bytes, human_count, human_time, spec_text


def models_table(infos: Iterable[Any]) -> Table:
    table = Table(title="Auto-MAP model zoo")
    table.add_column("model", style="bold")
    table.add_column("parameters", justify="right")
    table.add_column("cluster")
    table.add_column("what")
    for info in infos:
        params = "—" if info.nominal_params is None else human_count(info.nominal_params)
        table.add_row(info.name, params, info.default_cluster, info.description)
    return table


def capture_summary(graph: Graph) -> dict[str, Any]:
    prims = Counter(op.primitive for op in graph.ops)
    unknown = sorted({op.primitive for op in graph.ops if not op.known})
    return {
        "ops": len(graph.ops),
        "tensors": len(graph.tensors),
        "inputs": len(graph.inputs),
        "parameters": graph.param_count(),
        "flops": graph.total_flops,
        "bytes": {role.value: graph.role_bytes(role) for role in Role},
        "top_primitives": prims.most_common(8),
        "unknown_primitives": unknown,
        "fingerprint": graph.fingerprint,
    }


def groups_summary(graph: Graph, groups: Any) -> dict[str, Any]:
    stats = groups.stats()
    largest = sorted(groups.groups, key=lambda g: -g.bytes)[:8]
    return {
        "stats": stats,
        "largest": [
            {
                "group": g.id,
                "members": len(g.members),
                "bytes": g.bytes,
                "divisor": g.divisor,
                "batch": g.batch,
                "conflicted": g.conflicted,
                "example": (g.param_dims[0] if g.param_dims else None),
            }
            for g in largest
        ],
    }


def print_capture(console: Console, summary: Mapping[str, Any], groups: Mapping | None) -> None:
    table = Table(title="Captured training step", show_header=False)
    table.add_row("ops", str(summary["ops"]))
    table.add_row("tensors", str(summary["tensors"]))
    table.add_row("input leaves", str(summary["inputs"]))
    table.add_row("parameters", human_count(summary["parameters"]))
    table.add_row("FLOPs per step", human_count(summary["flops"]))
    for role, n in summary["bytes"].items():
        table.add_row(f"{role} bytes", human_bytes(n))
    table.add_row("top primitives", ", ".join(f"{p}×{n}" for p, n in summary["top_primitives"]))
    if summary["unknown_primitives"]:
        table.add_row("unknown (replicated)", ", ".join(summary["unknown_primitives"]))
    console.print(table)
    if groups:
        stats = Table(title="Linkage groups", show_header=False)
        for k, v in groups["stats"].items():
            stats.add_row(str(k), str(v))
        console.print(stats)
        big = Table(title="Largest groups by bytes")
        for col in ("group", "members", "bytes", "divisor", "batch", "conflicted", "example"):
            big.add_column(col)
        for row in groups["largest"]:
            big.add_row(*(human_bytes(v) if k == "bytes" else str(v) for k, v in row.items()))
        console.print(big)


def _pattern(path: str) -> str:
    return re.sub(r"\d+", "*", path)


def param_rows(plan: Plan) -> list[tuple[str, int, str]]:
    """One row per parameter pattern (layer numbers folded) and sharding."""
    roles = plan.decisions.get("arg_roles", {})
    param_args = {k for k, v in roles.items() if v == Role.PARAM.value} or {"0"}
    rows: Counter[tuple[str, str]] = Counter()
    for path, spec in plan.specs.items():
        arg = path[1 : path.index("]")] if path.startswith("[") else ""
        if arg in param_args:
            rows[(_pattern(path[path.index("]") + 1 :]), spec_text(spec))] += 1
    return [(pattern, count, spec) for (pattern, spec), count in sorted(rows.items())]


def plan_dict(plan: Plan) -> dict[str, Any]:
    d = plan.to_dict()
    d["parameter_rows"] = [
        {"pattern": p, "count": c, "sharding": s} for p, c, s in param_rows(plan)
    ]
    return d


def mesh_text(plan: Plan) -> str:
    """The mesh as axis=size, or "replicated" when the plan splits nothing on it."""
    mesh = " × ".join(f"{k}={v}" for k, v in plan.mesh.items()) or "one device"
    if plan.replicated and plan.devices > 1:
        return f"replicated on {plan.devices} devices (nothing split; mesh {mesh})"
    return mesh


def answer_line(plan: Plan) -> str:
    """The plan in one line: what --quiet prints when nothing else would show it."""
    line = f"{plan.name}: mesh {mesh_text(plan)}, ZeRO {plan.zero_stage}"
    if plan.pipelined:
        line += f", {len(plan.stages)} stages × {plan.microbatches} microbatches"
    cost = plan.predicted
    if cost is not None:
        line += (
            f", step {human_time(cost.step_time_s)}, {human_bytes(cost.memory_bytes)} per "
            f"device, {'feasible' if cost.feasible else 'infeasible: ' + str(cost.reason)}"
        )
    return line


def print_plan(console: Console, plan: Plan, cluster: Any) -> None:
    prov = plan.provenance
    what = prov.model or prov.fn or "step"
    console.print(
        f"[bold]Plan[/bold] for [bold]{what}[/bold] on {cluster.name} × {cluster.devices} "
        f"— {plan.name} (searcher {prov.searcher}, {prov.search_time_s:.1f} s)"
    )
    mesh = mesh_text(plan)
    console.print(
        f"mesh: {mesh}   ZeRO stage: {plan.zero_stage}   microbatches: {plan.microbatches}"
        + (f"   remat: {plan.remat_label}" if plan.remat else "")
        + ("   attention: flash" if plan.attention == "flash" else "")
    )
    for text in prov.notes:  # what the search could not do here, and why
        console.print(f"[yellow]note:[/yellow] {escape(text)}")
    if plan.pipelined:
        console.print(stages_table(plan))
    table = Table(title="Parameters")
    table.add_column("parameter (layers folded)")
    table.add_column("×", justify="right")
    table.add_column("sharding")
    for pattern, count, spec in param_rows(plan):
        # Escaped: Rich reads "[model]" or "['params']" as markup tags and prints nothing.
        table.add_row(escape(pattern), str(count), escape(spec))
    console.print(table)
    cost = plan.predicted
    if cost is not None:
        c = Table(title="Predicted cost per device", show_header=False)
        c.add_row("step time", human_time(cost.step_time_s))
        c.add_row("  compute", human_time(cost.compute_s))
        c.add_row("  communication", human_time(cost.comm_s))
        c.add_row("  pipeline bubble", human_time(cost.bubble_s))
        c.add_row(
            "memory per device, at its peak",
            f"{human_bytes(cost.memory_bytes)} of {human_bytes(cluster.memory_limit)}",
        )
        # The parts are what is alive at that moment: where the peak is the update (a step
        # that donates nothing writes its new state beside the old), no activations.
        for k, v in cost.memory_breakdown.items():
            c.add_row(f"  {k}", human_bytes(v))
        c.add_row("MFU", f"{cost.mfu:.1%}")
        c.add_row("feasible", "yes" if cost.feasible else f"no: {cost.reason}")
        console.print(c)


def stages_table(plan: Plan) -> Table:
    """A pipeline plan's stages: where each starts, its devices and mesh, its time per
    microbatch and memory (from the plan's decisions), with the schedule and bubble."""
    cost = plan.predicted
    v, n = plan.virtual_stages, len(plan.stages)
    stages = f"{n} stages" if v == 1 else f"{n} stages ({n // v} device groups × {v} chunks)"
    title = f"Pipeline: {stages}, {plan.microbatches} microbatches, {plan.schedule}"
    if cost is not None and cost.step_time_s > 0:
        share = cost.bubble_s / cost.step_time_s
        title += f", bubble {human_time(cost.bubble_s)} ({share:.0%} of the step)"
    table = Table(title=title, caption_justify="left")
    head = ("stage", "ops", "devices", "stage mesh", "fwd / mb", "bwd / mb", "memory")
    for col in head:
        table.add_column(
            col, justify="right" if col in ("fwd / mb", "bwd / mb", "memory") else "left"
        )
    for row in stage_rows(plan):
        table.add_row(*(escape(c) for c in row))
    table.caption = (
        "ops: the stage's range of op indices (its forward ops; backward and update ops "
        "follow their inputs' stage). mb: one microbatch."
    )
    return table


def print_check(console: Console, result: Mapping[str, Any]) -> None:
    if not result.get("checked", True) and "reason" in result and "mesh" not in result:
        console.print(f"[yellow]not checked:[/yellow] {result['reason']}")
        return
    if result.get("reduced"):
        console.print(
            f"{result['reason']}: checked a reduced variant ({result['overrides']}) "
            f"on mesh {result['mesh']}."
        )
    where = f" ({result['platform'].upper()})" if result.get("platform") else ""
    if not result.get("checked"):
        console.print(f"ran on mesh {result['mesh']}{where}.")
        return
    verdict = "[green]equal[/green]" if result["equal"] else "[red]DIFFERENT[/red]"
    # A difference names its leaf (the first out of tolerance, with its own error).
    leaf = (
        "" if result["equal"] or not result.get("worst_output") else f" in {result['worst_output']}"
    )
    console.print(
        f"sharded{where} vs unsharded step: {verdict} "
        f"(max abs error {result['max_abs_err']:.2e}{leaf})"
    )
