"""The `automap` command line: a thin Typer shell over the Python API.

Every command prints a Rich table for people, or JSON with `--json`; an error a user can
cause (a bad model name, a corrupt plan) is printed as one line naming the fix, with exit
code 2, never as a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from ._errors import AutomapError

app = typer.Typer(
    name="automap",
    help="Auto-MAP: find, check and apply distributed execution plans for JAX training steps.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()

ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Zoo model name (see `automap models`).")
]
FnOpt = Annotated[
    str | None,
    typer.Option(
        "--fn", help="package.module:function returning (step_fn, args) for your own step."
    ),
]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Model override KEY=VALUE (layers, hidden, heads, batch, seq, image, dtype...); repeatable.",
    ),
]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster", "-c", help="Preset name (a100, h100, ...) or a cluster YAML/JSON file."
    ),
]
DevicesOpt = Annotated[
    int, typer.Option("--devices", "-n", help="Number of devices in the cluster.")
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print only what is asked for (errors still show).")
]


def _friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print an error the user can fix as one line (exit code 2), not a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except AutomapError as e:
            Console(stderr=True).print(f"[bold red]error:[/bold red] {e}", highlight=False)
            raise typer.Exit(2) from None

    return wrapper


def _cpu_devices(n: int) -> None:
    """Give this process `n` virtual CPU devices; must run before JAX starts a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(n, 1))


@app.command()
@_friendly
def models(as_json: JsonOpt = False) -> None:
    """List the built-in benchmark models."""
    from ._zoo import list_models

    infos = list_models()
    if as_json:
        print(json.dumps([_info_dict(i) for i in infos], indent=2))
        return
    from ._report_text import models_table

    console.print(models_table(infos))


@app.command("capture")
@_friendly
def capture_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    groups: Annotated[
        bool, typer.Option("--groups", help="Also print the linkage groups.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Capture a training step and summarize its program: ops, parameters, FLOPs, memory."""
    from ._capture import capture
    from ._report_text import capture_summary, groups_summary

    step_fn, args, _ = _load_step(model, fn, override)
    graph = capture(step_fn, *args)
    summary = capture_summary(graph)
    group_info = None
    if groups:
        from ._linkage import build_groups

        group_info = groups_summary(graph, build_groups(graph))
    if as_json:
        print(json.dumps({"capture": summary, "groups": group_info}, indent=2, default=str))
        return
    from ._report_text import print_capture

    print_capture(console, summary, group_info)


@app.command("plan")
@_friendly
def plan_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    cluster: ClusterOpt = "a100",
    devices: DevicesOpt = 8,
    searcher: Annotated[
        str, typer.Option(help="dqn, ilp, dp, exhaustive, expert, random, mcmc, or auto.")
    ] = "auto",
    budget: Annotated[float, typer.Option("--budget", help="Search budget in seconds.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same plan.")] = 0,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the plan as JSON here.")
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Find a plan for a model on a cluster and print it (mesh, shardings, predicted cost)."""
    from ._api import plan
    from ._report_text import plan_dict, print_plan

    step_fn, args, origin = _load_step(model, fn, override)
    the_cluster = _load_cluster(cluster, devices)
    result = plan(
        step_fn,
        *args,
        cluster=the_cluster,
        searcher=searcher,
        budget_s=budget,
        seed=seed,
        origin=origin,
        progress=not (quiet or as_json),
    )
    curve_path = None
    if output is not None:
        result.save(output)
        if result.decisions.get("curve"):
            from .rl import write_curve

            # Next to the plan, where `automap report` looks for it.
            curve_path = output.with_name(output.stem + ".curve.csv")
            write_curve(result.decisions["curve"], curve_path)
    if as_json:
        print(json.dumps(plan_dict(result), indent=2))
    elif not quiet:
        print_plan(console, result, the_cluster)
        if output is not None:
            console.print(f"plan saved to [bold]{output}[/bold]")
        if curve_path is not None:
            console.print(f"learning curve saved to [bold]{curve_path}[/bold]")


@app.command("compare")
@_friendly
def compare_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    cluster: ClusterOpt = "a100",
    devices: DevicesOpt = 8,
    searchers: Annotated[
        str, typer.Option(help="Comma-separated searchers to run side by side.")
    ] = "expert,exhaustive,random,mcmc",
    budget: Annotated[float, typer.Option("--budget", help="Budget per searcher, seconds.")] = 30.0,
    seed: Annotated[int, typer.Option(help="Random seed for every searcher.")] = 0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the rows as JSON to this file.")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Every searcher side by side on one model and cluster, under the same cost model."""
    from ._compare import compare, to_json
    from ._report_text import compare_table

    step_fn, args, origin = _load_step(model, fn, override)
    the_cluster = _load_cluster(cluster, devices)
    names = [s.strip() for s in searchers.split(",") if s.strip()]
    with console.status("planning...", spinner="dots") as status:

        def progress(row) -> None:
            status.update(f"planning... {row.searcher} done ({row.search_time_s:.1f} s)")

        rows = compare(
            step_fn,
            *args,
            cluster=the_cluster,
            searchers=names,
            budget_s=budget,
            seed=seed,
            origin=origin,
            on_row=None if quiet else progress,
        )
    what = origin.get("model") or origin.get("fn")
    if json_out is not None:
        json_out.write_text(json.dumps(to_json(what, the_cluster, rows), indent=2) + "\n")
    if not quiet:
        console.print(compare_table(what, the_cluster, rows))
        if json_out is not None:
            console.print(f"rows written to [bold]{json_out}[/bold]")


@app.command("apply")
@_friendly
def apply_cmd(
    plan_file: Annotated[Path, typer.Argument(help="A plan made by `automap plan -o`.")],
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Run the plan on the local devices and compare with the unsharded step."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a saved plan on the local devices; with --check, compare its numbers with one device."""
    from ._plan import Plan

    the_plan = Plan.load(plan_file)
    _cpu_devices(max(8, the_plan.devices))
    from ._check import check_plan

    result = check_plan(the_plan, run_only=not check)
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        from ._report_text import print_check

        print_check(console, result)
    if check and not result["equal"]:
        raise typer.Exit(1)


@app.command("verify")
@_friendly
def verify_cmd(
    plan_file: Annotated[Path, typer.Argument(help="A plan made by `automap plan -o`.")],
    numerics: Annotated[
        bool,
        typer.Option("--numerics", help="Also run it on random arguments and compare numbers."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compile a plan with XLA on a CPU mesh of its shape and hold XLA's collectives against
    the cost model's (kind, mesh axis, bytes)."""
    from ._verify import verify_in_subprocess

    report = verify_in_subprocess(plan_file, concrete=numerics)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.print(escape(report.summary()))
    if report.collectives_match is False or report.numerics_ok is False:
        raise typer.Exit(1)


@app.command("calibrate")
@_friendly
def calibrate_cmd(
    devices: Annotated[
        int, typer.Option("--devices", "-n", help="Virtual CPU devices to measure (CPU only).")
    ] = 8,
    output: Annotated[Path, typer.Option("-o", "--output", help="Cluster file to write.")] = Path(
        "cluster.yaml"
    ),
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: seconds, rougher.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure the local devices (matmul rate, memory bandwidth, all-reduce bandwidth and
    latency over a mesh axis) and write a cluster file for --cluster."""
    _cpu_devices(devices)
    import jax

    from ._calibrate import measure, to_cluster, write_cluster

    cal = measure(quick=quick)
    memory = None
    if jax.devices()[0].platform == "cpu":
        # Virtual CPU devices share the machine's memory.
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cal.devices
    path = write_cluster(to_cluster(cal, memory_bytes=memory), output)
    if as_json:
        print(json.dumps({"calibration": dataclasses.asdict(cal), "file": str(path)}, indent=2))
        return
    console.print(
        f"{cal.devices} {cal.platform} devices: matmul {cal.matmul_flops / 1e9:.1f} GFLOP/s, "
        f"memory {cal.memory_bandwidth / 1e9:.1f} GB/s, all-reduce link "
        f"{cal.link_bandwidth / 1e9:.2f} GB/s, latency {cal.link_latency * 1e6:.1f} us"
    )
    console.print(f"cluster written to [bold]{path}[/bold] (use --cluster {path})")


@app.command("report")
@_friendly
def report_cmd(
    plan_file: Annotated[Path, typer.Argument(help="A plan made by `automap plan -o`.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write.")] = Path(
        "report.html"
    ),
    png: Annotated[
        Path | None, typer.Option("--png", help="Also write the panels as one PNG.")
    ] = None,
    curve: Annotated[
        Path | None,
        typer.Option("--curve", help="Learning-curve CSV (default: <plan>.curve.csv if present)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Draw a plan: mesh, shardings, pipeline schedule, memory, learning curve, step time."""
    from ._report import write_report

    path = write_report(plan_file, output, png=png, curve=curve)
    if not quiet:
        console.print(f"report written to [bold]{path}[/bold]" + (f" and {png}" if png else ""))


@app.command("bench")
@_friendly
def bench_cmd(
    quick: Annotated[
        bool, typer.Option("--quick", help="4 small-to-mid models, 3 s budgets: a few minutes.")
    ] = False,
    budget: Annotated[
        float | None,
        typer.Option("--budget", help="Seconds per searcher and seed (default 3 quick, 20 full)."),
    ] = None,
    seeds: Annotated[int, typer.Option("--seeds", help="Seeds per learned searcher.")] = 1,
    models: Annotated[
        str | None, typer.Option("--models", help="Comma-separated zoo models (default: all).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Markdown file to write.")] = Path(
        "BENCHMARKS.md"
    ),
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write every row as JSON here.")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Every zoo model on its preset clusters: data parallel, best expert, exact optimum,
    DQN, random and MCMC; the cost model's fidelity against XLA and its speed."""
    from . import _bench
    from ._bench_md import write

    if seeds < 1 or (budget is not None and budget <= 0):
        raise AutomapError("--seeds must be at least 1 and --budget positive (e.g. --budget 5).")
    names = [m.strip() for m in models.split(",") if m.strip()] if models else None
    # The command as it reproduces this run, every default spelled out.
    command = "automap bench" + (" --quick" if quick else "")
    command += f" --budget {budget:g}" if budget is not None else ""
    command += f" --seeds {seeds}" + (f" --models {','.join(names)}" if names else "")
    command += f" --out {out}" if out is not None else ""
    settings = (_bench.quick_settings if quick else _bench.full_settings)(command, seeds=seeds)
    if budget is not None:
        settings = dataclasses.replace(settings, budget_s=budget)
    cases = _bench.select(_bench.QUICK if quick else _bench.FULL, names)
    result = _bench.run_bench(cases, settings, progress=not quiet)
    write(result, out, json_out)
    if not quiet:
        console.print(f"benchmarks written to [bold]{out}[/bold] in {result['wall_s']:.0f} s")


def _info_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(info)


def _parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise AutomapError(f"--set takes KEY=VALUE, got {item!r} (e.g. --set layers=2).")
        key, raw = item.split("=", 1)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word such as float32
        out[key.strip()] = value
    return out


def _load_step(model: str | None, fn: str | None, override: list[str] | None):
    """(step_fn, args, origin) from a zoo model or a user's `module:function`."""
    from ._origin import load_fn, load_zoo

    if (model is None) == (fn is None):
        raise AutomapError("give exactly one of --model NAME or --fn package.module:function.")
    if model is not None:
        return load_zoo(model, _parse_overrides(override), abstract=True)
    if override:
        raise AutomapError(
            "--set overrides apply to zoo models; change your --fn function instead."
        )
    return load_fn(fn)


def _load_cluster(cluster: str, devices: int):
    from ._cluster import Cluster

    path = Path(cluster)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return Cluster.from_file(path).with_devices(devices)
    return Cluster.preset(cluster, devices=devices)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
