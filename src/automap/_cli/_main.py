"""The `automap` command line: a thin Typer shell over the Python API.

This module holds the search commands (`plan`, `compare`) and the entry point; the tools
that read, run or draw a plan live in `_tools.py`, and what all commands share (the app,
common options, progress/quiet/JSON conventions, friendly errors) in `_app.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from .._errors import AutomapError
from ._app import (
    INTERRUPTED,
    TERMINATED,
    ClusterOpt,
    DevicesOpt,
    FnOpt,
    JsonOpt,
    LegacyCommand,
    ModelOpt,
    OverrideOpt,
    QuietOpt,
    SlicesOpt,
    TopologyOpt,
    app,
    busy,
    check_budget,
    check_output,
    check_seed,
    console,
    friendly,
    held_save_warnings,
    json_flags,
    leave_now,
    load_cluster,
    load_step,
    note,
    print_json,
    sigterm_as_interrupt,
    unused_path,
    write_or_keep,
)

__all__ = ["app", "main"]

SeedOpt = Annotated[int, typer.Option(help="Random seed: the same seed gives the same plan.")]
JsonOutOpt = Annotated[
    Path | None, typer.Option("--json-out", help="Also write the rows as JSON to this file.")
]
LegacyJsonArg = Annotated[
    Path | None,
    typer.Argument(hidden=True, help="Old spelling `--json FILE`: now `--json-out FILE`."),
]


@app.command("plan")
@friendly
def plan_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    cluster: ClusterOpt = "a100",
    devices: DevicesOpt = None,
    topology: TopologyOpt = None,
    slices: SlicesOpt = 1,
    searcher: Annotated[
        str, typer.Option(help="dqn, ilp, dp, exhaustive, expert, random, mcmc, or auto.")
    ] = "auto",
    budget: Annotated[
        float,
        typer.Option(
            "--budget",
            help="Search budget in seconds (positive); inf: no limit, for the searchers that "
            "end on their own (ilp, exhaustive, dp, expert).",
        ),
    ] = 60.0,
    seed: SeedOpt = 0,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Write the plan as JSON here (and its curve next to it)."
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    agent: Annotated[
        Path | None,
        typer.Option(
            "--agent", help="DQN: warm-start from the network of this saved agent (--save-agent)."
        ),
    ] = None,
    save_agent: Annotated[
        Path | None,
        typer.Option("--save-agent", help="DQN: save the trained agent to this file."),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="DQN: continue the search saved next to -o's plan (a stopped search, or a "
            "finished one given a larger total --budget).",
        ),
    ] = False,
) -> None:
    """Find a plan for a model on a cluster and print it: mesh, shardings, predicted cost.

    Ctrl-C saves the best plan so far (to -o, else a new plan.json) and exits with 130;
    SIGTERM (a scheduler's time limit) does the same and exits with 143.
    With -o, the DQN also keeps its search state next to the plan (plan.search.msgpack):
    --resume continues from it.

    Example: automap plan --model bert-large --cluster a100 --devices 16 -o plan.json
    """
    from .._api import plan
    from .._report import answer_line, plan_dict, print_plan

    check_budget(budget, (searcher,))
    check_seed(seed)
    check_output(output, "-o")
    check_output(save_agent, "--save-agent")
    state = _search_state(output, searcher, resume)
    with sigterm_as_interrupt() as signalled, held_save_warnings() as held:
        try:
            step_fn, args, origin = load_step(model, fn, override)
            the_cluster = load_cluster(cluster, devices, topology, slices)
            result = plan(
                step_fn,
                *args,
                cluster=the_cluster,
                searcher=searcher,
                budget_s=budget,
                seed=seed,
                origin=origin,
                progress=not (quiet or as_json),
                agent_in=agent,
                agent_out=save_agent,
                resume=state,
            )
        except KeyboardInterrupt:
            note("interrupted before any feasible plan was found; nothing saved.")
            raise typer.Exit(_stop_code(signalled)) from None
    # A Ctrl-C whose KeyboardInterrupt JAX swallowed (raised in one of its callbacks)
    # let a search run on that polls nothing: it still ends the command as Ctrl-C does.
    interrupted = bool(result.decisions.get("interrupted")) or signalled["interrupted"]
    # The answer is printed before any file is written: a failed write must not lose it.
    if as_json:
        print_json(plan_dict(result))
    elif quiet and output is None:
        console.print(answer_line(result), highlight=False, soft_wrap=True, markup=False)
    elif not (quiet or interrupted):
        print_plan(console, result, the_cluster)
    if interrupted and output is None:
        # The user asked for no file, but an interrupted search printed nothing: keep it.
        output = unused_path(Path("plan.json"))
    for line in held:  # the search's own files (DQN state, agent): after the answer
        note(line)
    unsaved: list[str] = []
    saved = _save(result, output, unsaved) if output is not None else {}
    if not (quiet or as_json or interrupted):
        for what, path in saved.items():
            if what not in unsaved:  # the others were said on stderr
                console.print(f"{what} saved to [bold]{path}[/bold]")
        if state is not None and state.exists() and not held:
            console.print(f"search state saved to [bold]{state}[/bold] (go on with --resume)")
    if interrupted:
        how = "terminated (SIGTERM)" if signalled["terminated"] else "interrupted"
        kept = f"is saved to {saved['plan']}" if "plan" in saved else "could not be saved"
        note(f"search {how}: the best plan so far {kept}")
        raise typer.Exit(_stop_code(signalled))
    if result.decisions.get("cut_short") or result.decisions.get("complete") is False:
        note(
            f"the budget ({budget:g} s) cut the {result.provenance.searcher} search short: "
            "this is the best plan found, not a proven optimum (raise --budget)."
        )
    if held or unsaved:
        raise typer.Exit(1)


def _stop_code(signalled: dict[str, bool]) -> int:
    """130 after Ctrl-C, 143 after SIGTERM: the codes a shell reports for them."""
    return TERMINATED if signalled["terminated"] else INTERRUPTED


def _search_state(output: Path | None, searcher: str, resume: bool) -> Path | None:
    """Where the DQN keeps its search state: next to the plan, like its curve. A search
    without --resume starts afresh, so an older state there is removed first. Only the
    DQN keeps one: `auto` is the ILP and the stage DP, which finish on their own."""
    if searcher != "dqn":
        if resume:
            raise AutomapError(f"--resume is for the dqn searcher, not {searcher}")
        return None
    if output is None:
        if resume:
            raise AutomapError(
                "--resume needs -o PLAN: the search state is kept next to the plan it made"
            )
        return None
    state = output.with_name(output.stem + ".search.msgpack")
    if resume and not state.exists():
        raise AutomapError(
            f"nothing to resume: no search state at {state}; run the same command "
            "without --resume first"
        )
    if not resume:
        state.unlink(missing_ok=True)
    return state


def _save(result: Any, output: Path, unsaved: list[str]) -> dict[str, Path]:
    """Write the plan, and the DQN's learning curve next to it (where `automap report`
    looks for it): {what: where} of what was written. A write that fails is kept where
    Ctrl-C keeps a plan, or said in one line (`write_or_keep`), and named in `unsaved`."""
    from ..rl import write_curve

    saved = {}
    where = write_or_keep(result.save, output, "plan", Path("plan.json"))
    if where is not None:
        saved["plan"] = where
    if where != output:
        unsaved.append("plan")
    curve = result.decisions.get("curve")
    if curve:
        base = where or output
        path = base.with_name(base.stem + ".curve.csv")
        curve_at = write_or_keep(
            functools.partial(write_curve, curve), path, "learning curve", Path(path.name)
        )
        if curve_at is not None:
            saved["learning curve"] = curve_at
        if curve_at != path:
            unsaved.append("learning curve")
    return saved


class _Stop(Exception):
    """Raised from compare's row callback to end the comparison after an interrupted row."""


def _searcher_names(searchers: str) -> list[str]:
    """compare's --searchers as a list of known names, or one error listing them."""
    from .._api import SEARCHERS

    names = [s.strip() for s in searchers.split(",") if s.strip()]
    unknown = [n for n in names if n not in SEARCHERS]
    if unknown or not names:
        raise AutomapError(
            f"unknown searcher(s) {', '.join(unknown) or '(none given)'}; --searchers takes "
            f"a comma-separated list of {', '.join(SEARCHERS)} (e.g. --searchers expert,random)."
        )
    return names


@dataclasses.dataclass(frozen=True)
class _CompareRun:
    """One comparison, as the command line asked for it (checked)."""

    step_fn: Any
    args: Any
    origin: dict[str, Any]
    cluster: Any
    names: list[str]
    budget: float
    seed: int

    def rows(self, show_progress: bool) -> tuple[list[Any], bool, dict[str, bool]]:
        """(the rows, whether Ctrl-C or SIGTERM ended the comparison early, which signal)."""
        from .._bench import compare

        rows: list[Any] = []  # kept here too, so that Ctrl-C still has the rows so far
        interrupted = False
        with (
            busy("planning...", show_progress) as status,
            sigterm_as_interrupt() as signalled,
        ):

            def on_row(row: Any) -> None:
                if row.plan is not None and row.plan.decisions.get("interrupted"):
                    rows.append(dataclasses.replace(row, note="interrupted: best plan so far"))
                    raise _Stop
                rows.append(row)
                if status is not None:
                    status.update(f"planning... {row.searcher} done ({row.search_time_s:.1f} s)")

            try:
                compare(
                    self.step_fn,
                    *self.args,
                    cluster=self.cluster,
                    searchers=self.names,
                    budget_s=self.budget,
                    seed=self.seed,
                    origin=self.origin,
                    on_row=on_row,
                )
            except (_Stop, KeyboardInterrupt):
                interrupted = True
        return rows, interrupted, signalled


def _print_compare_table(what: str, cluster: Any, rows: list[Any]) -> None:
    from .._bench import compare_table

    table = compare_table(what, cluster, rows)
    # Off a terminal Rich assumes 80 columns and wraps every cell: give the table the
    # width it needs instead, so that a log or a file keeps one row per line.
    if console.is_terminal:
        console.print(table)
    else:
        wide = console.options.update_width(1000)
        Console(width=console.measure(table, options=wide).maximum).print(table)


@app.command("compare", cls=LegacyCommand)
@friendly
def compare_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    cluster: ClusterOpt = "a100",
    devices: DevicesOpt = None,
    topology: TopologyOpt = None,
    slices: SlicesOpt = 1,
    searchers: Annotated[
        str, typer.Option(help="Comma-separated searchers to run side by side.")
    ] = "expert,exhaustive,random,mcmc",
    budget: Annotated[
        float, typer.Option("--budget", help="Budget per searcher, seconds (positive).")
    ] = 30.0,
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    json_out: JsonOutOpt = None,
    quiet: QuietOpt = False,
    legacy_json: LegacyJsonArg = None,
) -> None:
    """Run every searcher side by side on one model and cluster, under the same cost model.

    Ctrl-C prints the rows so far (with the running searcher's best plan) and exits with 130.

    Example: automap compare --model mlp --devices 8 --searchers expert,ilp,dqn --json-out rows.json
    """
    from .._bench import to_json

    as_json, json_out = json_flags(as_json, legacy_json, json_out)
    names = _searcher_names(searchers)
    check_output(json_out, "--json-out")
    check_budget(budget, names)
    check_seed(seed)
    step_fn, args, origin = load_step(model, fn, override)
    the_cluster = load_cluster(cluster, devices, topology, slices)
    run = _CompareRun(step_fn, args, origin, the_cluster, names, budget, seed)
    rows, interrupted, signalled = run.rows(show_progress=not (quiet or as_json))
    what = origin.get("model") or origin.get("fn")
    data = to_json(what, the_cluster, rows) | ({"interrupted": True} if interrupted else {})
    if as_json:
        print_json(data)
    elif not quiet:
        _print_compare_table(what, the_cluster, rows)
    # The rows are printed before the file is written: a full disk must not lose them.
    written = None
    if json_out is not None:
        text = json.dumps(data, indent=2, default=str) + "\n"
        written = write_or_keep(
            lambda path: path.write_text(text), json_out, "the rows", Path("rows.json")
        )
        if written == json_out and not (quiet or as_json):
            console.print(f"rows written to [bold]{json_out}[/bold]")
    if interrupted:
        how = "terminated (SIGTERM)" if signalled["terminated"] else "interrupted"
        note(f"comparison {how}: {len(rows)} row(s) so far, the rest skipped.")
        raise typer.Exit(_stop_code(signalled))
    if json_out is not None and written != json_out:
        raise typer.Exit(1)


@app.command("estimate")
@friendly
def estimate_cmd(
    model: ModelOpt = None,
    fn: FnOpt = None,
    override: OverrideOpt = None,
    cluster: ClusterOpt = "a100",
    devices: DevicesOpt = None,
    topology: TopologyOpt = None,
    slices: SlicesOpt = 1,
    tp: Annotated[int, typer.Option("--tp", help="Tensor parallel size, inside a node.")] = 1,
    pp: Annotated[
        int,
        typer.Option(
            "--pp", help="Pipeline stages, equal in layers (else the end stages hold one fewer)."
        ),
    ] = 1,
    dp: Annotated[
        int, typer.Option("--dp", help="Data parallel size (tp x pp x dp = devices).")
    ] = 1,
    microbatch_size: Annotated[
        int | None,
        typer.Option("--microbatch-size", help="Sequences per microbatch per data replica."),
    ] = None,
    microbatches: Annotated[
        int | None, typer.Option("--microbatches", help="Microbatches per step (pipelines).")
    ] = None,
    schedule: Annotated[
        str, typer.Option(help="Pipeline schedule: 1f1b, gpipe, interleaved or zb-h1.")
    ] = "1f1b",
    virtual_stages: Annotated[
        int,
        typer.Option(
            "--virtual-stages",
            help="Model chunks per pipeline stage (interleaved's v; chunks as --pp splits stages).",
        ),
    ] = 1,
    remat: Annotated[
        str,
        typer.Option(
            help="Recomputation: none, selective (attention cores), projections (all but "
            "the projections: MaxText's minimal) or full."
        ),
    ] = "none",
    remat_layers: Annotated[
        int | None,
        typer.Option(
            "--remat-layers",
            help="With --remat full: recompute only the first K layers of each stage.",
        ),
    ] = None,
    zero: Annotated[int, typer.Option(help="ZeRO stage over the data axis: 0, 1, 2 or 3.")] = 0,
    sequence_parallel: Annotated[
        bool,
        typer.Option(
            "--sequence-parallel",
            help="Split the residual stream on the sequence over the tensor-parallel axis.",
        ),
    ] = False,
    attention: Annotated[
        str,
        typer.Option(
            help="Attention cores: written (as the program writes them) or flash (the "
            "Pallas flash kernel: TPU targets)."
        ),
    ] = "written",
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the priced plan as JSON here.")
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Price a configuration you already run (Megatron-LM style): tensor parallel, pipeline
    stages, data parallel, microbatches, schedule, recomputation and ZeRO.

    Example: automap estimate --model gpt-1.3b --devices 16 --tp 8 --pp 2 --dp 1 --microbatch-size 1 --remat full
    """
    from .._api import plan_recipe
    from .._report import print_plan
    from .._space import Recipe

    check_output(output, "-o")
    step_fn, args, origin = load_step(model, fn, override)
    the_cluster = load_cluster(cluster, devices, topology, slices)
    recipe = Recipe(
        tp=tp, pp=pp, dp=dp, microbatch_size=microbatch_size, microbatches=microbatches,
        schedule=schedule, virtual_stages=virtual_stages, remat=remat, remat_layers=remat_layers,
        zero=zero,
        sequence_parallel=sequence_parallel,
        attention=attention,
        name=f"tp{tp} pp{pp} dp{dp}" + (f" v{virtual_stages}" if virtual_stages > 1 else "")
        + (" sp" if sequence_parallel else ""),
    )  # fmt: skip
    with busy("pricing", not (quiet or as_json)):
        result = plan_recipe(step_fn, *args, recipe=recipe, cluster=the_cluster, origin=origin)
    if as_json:
        cost = result.predicted.to_dict()
        print_json({**cost, "microbatches": result.microbatches, "plan": result.to_dict()})
    elif quiet:
        cost = result.predicted
        fits = "fits" if cost.feasible else "does not fit"
        console.print(
            f"{cost.step_time_s:.6g} s per step, {cost.memory_bytes / 1e9:.3g} GB per device ({fits})"
        )
    else:
        print_plan(console, result, the_cluster)
    # Written after the answer is printed: a full disk must not lose it.
    if output is not None:
        where = write_or_keep(result.save, output, "plan", Path("plan.json"))
        if where != output:
            raise typer.Exit(1)
        if not (quiet or as_json):
            console.print(f"plan saved to [bold]{output}[/bold]")


def main() -> None:
    """The `automap` command. A command stopped by Ctrl-C or SIGTERM leaves at once once
    its one-line message is out: a signal that lands inside JAX/XLA (tracing, a compile)
    can leave its runtime in a state whose teardown at interpreter exit crashed (a
    segfault after the message in 3 of 10 runs of `plan --fn`, issue 28), so the process
    skips the teardown (`os._exit`) instead of risking it. Everything the command saves
    is written and closed before the exit code is raised.

    Python's cycle collector runs at a young collection per 10,000 net allocations, not
    700: a plan's graph, jaxpr and cost tables are millions of live objects, which each
    older collection walks again; at the defaults the collector took a quarter of the CPU
    of pricing a 48-layer GPT (Korthikanti's 22B row: 7.9 of 30.8 s; 1.8 s at these, with
    the same peak memory). Set here, for the command's own process; a library call leaves
    the caller's collector as it is (the test suite sets the same in tests/conftest.py)."""
    gc.set_threshold(10_000, 20, 10)
    try:
        app()
    except SystemExit as stop:
        if stop.code in (INTERRUPTED, TERMINATED):
            leave_now(stop.code)
        raise


if __name__ == "__main__":
    main()
