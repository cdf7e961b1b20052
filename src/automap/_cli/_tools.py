"""The `automap` commands around a search: list and capture models, run, verify and draw a
saved plan, measure the local devices, and run the benchmarks.

They follow the conventions in `_app.py`: progress on stderr, `--quiet`, `--json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from .._errors import AutomapError
from ._app import (
    FnOpt,
    JsonOpt,
    LegacyCommand,
    ModelOpt,
    OverrideOpt,
    PlanFileArg,
    QuietOpt,
    app,
    busy,
    check_budget,
    check_devices,
    check_output,
    check_plan_file,
    console,
    cpu_devices,
    friendly,
    json_flags,
    load_step,
    print_json,
    run_devices,
    write_or_keep,
)

if TYPE_CHECKING:  # the CLI imports the stages lazily, for its start-up time
    from .._bench import Settings


@app.command()
@friendly
def models(as_json: JsonOpt = False) -> None:
    """List the built-in benchmark models: name, family, parameters, what they stand for.

    Example: automap models --json
    """
    from .._zoo import list_models

    infos = list_models()
    if as_json:
        print_json([dataclasses.asdict(i) for i in infos])
        return
    from .._report import models_table

    console.print(models_table(infos))


@app.command("capture")
@friendly
def capture_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    groups: Annotated[
        bool, typer.Option("--groups", help="Also print the linkage groups.")
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Capture a training step and summarize its program: ops, parameters, FLOPs, memory.

    With --quiet, one line: ops, parameters and FLOPs.

    Example: automap capture --model bert-base --set layers=2 --groups
    """
    from .._capture import capture
    from .._report import capture_summary, groups_summary

    with busy("capturing the step...", not (quiet or as_json)):
        step_fn, args, _ = load_step(model, fn, override)
        graph = capture(step_fn, *args)
        summary = capture_summary(graph)
        group_info = None
        if groups:
            from .._groups import build_groups

            group_info = groups_summary(graph, build_groups(graph))
    if as_json:
        print_json({"capture": summary, "groups": group_info})
    elif quiet:
        print(
            f"{summary['ops']} ops, {summary['parameters']:,} parameters, "
            f"{summary['flops']:.3g} FLOPs per step"
        )
    else:
        from .._report import print_capture

        print_capture(console, summary, group_info)


@app.command("apply")
@friendly
def apply_cmd(
    plan_file: PlanFileArg,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Run the plan on the local devices and compare with the unsharded step."
        ),
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run a saved plan on the local devices; --check compares its numbers with one device.

    Exit code 1 when --check finds the numbers differ.

    Example: automap apply plan.json --check
    """
    from .._plan import Plan

    the_plan = Plan.load(check_plan_file(plan_file))
    devices = run_devices(the_plan.devices)
    from .._verify import check_saved_plan

    with busy("compiling and running the plan...", not (quiet or as_json)):
        result = check_saved_plan(the_plan, run_only=not check, devices=devices)
    if as_json:
        print_json(result)
    elif not quiet:
        from .._report import print_check

        print_check(console, result)
    if check and not result["equal"]:
        raise typer.Exit(1)


@app.command("verify")
@friendly
def verify_cmd(
    plan_file: PlanFileArg,
    numerics: Annotated[
        bool,
        typer.Option("--numerics", help="Also run it on random arguments and compare numbers."),
    ] = False,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Compile for this GPU (a100, h100, h200) or TPU topology (v5p:4x4x4, v5e:4x4) "
            "without one, and hold its collectives and memory against the cost model as it "
            "prices that device (a pipeline's programs stage by stage).",
        ),
    ] = None,
    hbm_gib: Annotated[
        float | None,
        typer.Option(
            "--hbm-gib",
            help="With a TPU --target: compile as if each chip had this much HBM (GiB), as "
            "for a plan that fills the chip; XLA's scheduler otherwise spends what a small "
            "program leaves free on overlap.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compile a plan with XLA on a CPU mesh and check its collectives against the cost model.

    Each collective XLA inserts (kind, mesh axis, bytes) is held against the cost model's;
    exit code 1 on a mismatch, or when --numerics finds different numbers.

    Example: automap verify plan.json --numerics
    """
    from .._verify import verify_in_subprocess

    check_plan_file(plan_file)
    if target and numerics:
        raise AutomapError("--numerics runs the plan, which --target only compiles: give one.")
    where = f"for {target}" if target else "on a CPU mesh"
    with busy(f"compiling with XLA {where}...", not (quiet or as_json)):
        hbm = hbm_gib * 2**30 if hbm_gib is not None else None
        report = verify_in_subprocess(plan_file, concrete=numerics, target=target, hbm_bytes=hbm)
    if as_json:
        print_json(report.to_dict())
    elif not quiet:
        console.print(escape(report.summary()))
    if report.collectives_match is False or report.numerics_ok is False:
        raise typer.Exit(1)


@app.command("report")
@friendly
def report_cmd(
    plan_file: PlanFileArg,
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
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Draw a plan: mesh, shardings, pipeline schedule, memory, learning curve, step time.

    Example: automap report plan.json -o report.html --png report.png
    """
    from .._report import write_report

    check_plan_file(plan_file)
    check_output(output, "-o")
    check_output(png, "--png")
    with busy("drawing the report...", not (quiet or as_json)):
        try:
            path = write_report(plan_file, output, png=png, curve=curve)
        except OSError as e:
            # A full disk: nothing is lost (the plan is drawn again from its file).
            where = e.filename or f"{output}" + (f" or {png}" if png else "")
            raise AutomapError(
                f"the report could not be written to {where} ({e.strerror or e}); free "
                "some space or choose another place with -o."
            ) from None
    if as_json:
        print_json({"html": str(path), "png": None if png is None else str(png)})
    elif not quiet:
        console.print(f"report written to [bold]{path}[/bold]" + (f" and {png}" if png else ""))


@app.command("calibrate")
@friendly
def calibrate_cmd(
    devices: Annotated[
        int, typer.Option("--devices", "-n", help="Virtual CPU devices to measure (CPU only).")
    ] = 8,
    output: Annotated[Path, typer.Option("-o", "--output", help="Cluster file to write.")] = Path(
        "cluster.yaml"
    ),
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: seconds, rougher.")] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Measure the local devices and write a cluster file for --cluster.

    Measured: matmul rate, memory bandwidth, all-reduce bandwidth and latency over a mesh axis.

    Example: automap calibrate --devices 8 --quick -o cluster.yaml
    """
    check_devices(devices)
    check_output(output, "-o")
    cpu_devices(devices)
    import jax

    from .._bench import measure, to_cluster, write_cluster

    with busy("measuring the devices...", not (quiet or as_json)):
        cal = measure(quick=quick)
    memory = None
    if jax.devices()[0].platform == "cpu":
        # Virtual CPU devices share the machine's memory.
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cal.devices
    cluster = to_cluster(cal, memory_bytes=memory)
    # The measurements are printed before the file is written: a full disk must not lose them.
    if as_json:
        print_json({"calibration": dataclasses.asdict(cal), "file": str(output)})
    elif not quiet:
        console.print(
            f"{cal.devices} {cal.platform} devices: matmul {cal.matmul_flops / 1e9:.1f} GFLOP/s, "
            f"memory {cal.memory_bandwidth / 1e9:.1f} GB/s, all-reduce link "
            f"{cal.link_bandwidth / 1e9:.2f} GB/s, latency {cal.link_latency * 1e6:.1f} us"
        )
    where = write_or_keep(
        lambda path: write_cluster(cluster, path), output, "cluster", Path("cluster.yaml")
    )
    if where != output:
        raise typer.Exit(1)
    if not (quiet or as_json):
        console.print(f"cluster written to [bold]{output}[/bold] (use --cluster {output})")


@app.command("bench", cls=LegacyCommand)
@friendly
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
    as_json: JsonOpt = False,
    json_out: Annotated[
        Path | None, typer.Option("--json-out", help="Also write every row as JSON here.")
    ] = None,
    quiet: QuietOpt = False,
    megatron_plan_s: Annotated[
        float | None,
        typer.Option(
            "--megatron-plan-s",
            help="Megatron-LM's published table: the planner's budget per row (s; 0 prices "
            "Megatron's configurations only). Default 30 on a full run of every model "
            "(about 10 min on two cores), off with --quick or --models.",
        ),
    ] = None,
    no_megatron: Annotated[
        bool, typer.Option("--no-megatron", help="Leave out Megatron-LM's published table.")
    ] = False,
    legacy_json: Annotated[
        Path | None,
        typer.Argument(hidden=True, help="Old spelling `--json FILE`: now `--json-out FILE`."),
    ] = None,
) -> None:
    """Benchmark every searcher on every zoo model and write BENCHMARKS.md.

    Each model on its preset clusters: data parallel, best expert, exact optimum, DQN,
    random and MCMC; then the cost model's fidelity against XLA and its speed; then
    Megatron-LM's published table, priced and planned.

    Example: automap bench --quick --out BENCHMARKS.md --json-out bench.json
    """
    from .._bench import FULL, QUICK, recorded_apart, run_bench, select, write

    as_json, json_out = json_flags(as_json, legacy_json, json_out)
    check_output(out, "--out")
    check_output(json_out, "--json-out")
    names = [m.strip() for m in models.split(",") if m.strip()] if models else None
    request = _BenchRequest(quick, budget, seeds, names, megatron_plan_s, no_megatron, out)
    request.check()
    cases = select(QUICK if quick else FULL, names)
    result = run_bench(cases, request.settings(), progress=not (quiet or as_json))
    if as_json:
        print(json.dumps(result, indent=1, default=str))
    # A full disk after minutes of benchmarks: each file is kept where Ctrl-C keeps one,
    # with what --out recorded apart, read before a failed write can truncate it.
    kept = recorded_apart(out) if out is not None else ""
    files = (
        ("benchmarks", out, "BENCHMARKS.md", lambda path: write(result, path, None, kept)),
        ("the rows", json_out, "bench.json", lambda path: write(result, None, path)),
    )
    failed = False
    for what, path, keep_as, write_to in files:
        if path is not None and write_or_keep(write_to, path, what, Path(keep_as)) != path:
            failed = True
    if failed:
        raise typer.Exit(1)
    if not (quiet or as_json) and out is not None:
        console.print(f"benchmarks written to [bold]{out}[/bold] in {result['wall_s']:.0f} s")


@dataclasses.dataclass(frozen=True)
class _BenchRequest:
    """What `automap bench` was asked for: the options that shape the run's settings."""

    quick: bool
    budget: float | None
    seeds: int
    names: list[str] | None
    """The --models given, or None for every model of the suite."""
    megatron_plan_s: float | None
    no_megatron: bool
    out: Path | None

    def check(self) -> None:
        """One error naming the fix for each option out of its range."""
        check_budget(self.budget)
        if self.seeds < 1:
            raise AutomapError(f"--seeds must be at least 1, got {self.seeds} (e.g. --seeds 3).")
        megatron_s = self.megatron_plan_s
        if megatron_s is not None and not megatron_s >= 0:
            raise AutomapError(
                "--megatron-plan-s must be 0 (price Megatron's configurations only) or the "
                f"planner's budget per row in seconds (e.g. 30), got {megatron_s:g}."
            )
        if megatron_s is not None and self.no_megatron:
            raise AutomapError(
                "--megatron-plan-s and --no-megatron contradict each other; give one."
            )

    def command(self) -> str:
        """The command as it reproduces this run, every default spelled out."""
        command = "automap bench" + (" --quick" if self.quick else "")
        command += f" --budget {self.budget:g}" if self.budget is not None else ""
        names = self.names
        command += f" --seeds {self.seeds}" + (f" --models {','.join(names)}" if names else "")
        megatron_s = self.megatron_plan_s
        command += f" --megatron-plan-s {megatron_s:g}" if megatron_s is not None else ""
        command += " --no-megatron" if self.no_megatron else ""
        command += f" --out {self.out}" if self.out is not None else ""
        return command

    def settings(self) -> Settings:
        """The benchmark's settings: the suite's defaults with the options given."""
        from .._bench import full_settings, quick_settings

        settings = (quick_settings if self.quick else full_settings)(
            self.command(), seeds=self.seeds
        )
        if self.budget is not None:
            settings = dataclasses.replace(settings, budget_s=self.budget)
        if self.megatron_plan_s is not None or self.no_megatron or self.names:
            # A run of a few models is about them: the table only when asked for.
            settings = dataclasses.replace(settings, megatron_plan_s=self.megatron_plan_s)
        return settings
