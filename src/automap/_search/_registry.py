"""The searchers by name: what each runs, which tasks it can search, and its "auto" task.

One table (`SEARCHERS`) replaces the if/elif chains over searcher names: `am.plan`, the
CLI, `compare` and the benchmarks all look a searcher up here. Input: a `Problem` and a
`Request`. Output: the searcher's best plan, priced, with its provenance.
DESIGN.md, "Searchers".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._errors import AutomapError, InfeasibleError
from .._plan import Plan, Provenance
from .._version import __version__
from ._classic import SAFETY, STOP
from ._dp import pipeline_notes, search_dp
from ._mesh_terms import COLUMNS_PER_SECOND
from ._one_stage import NAME as ONE_STAGE_NAME
from ._one_stage import OneStagePolish
from ._problem import (
    Problem,
    arg_roles,
    best_expert,
    memory_floor,
    no_worse_than_experts,
    priced_experts,
)
from ._runner import (
    DQNFiles,
    SearchProgress,
    leanest_point,
    one_stage_ilp,
    run_space_searcher,
    with_stats,
)
from ._work import Work

#: The exploration tasks a user can ask for (`tasks=`); "hybrid" is shard and pipeline.
TASKS = ("shard", "replicate", "pipeline")
ONE_STAGE = frozenset({"shard", "replicate"})
ALL_TASKS = frozenset({"shard", "replicate", "pipeline", "hybrid"})


@dataclasses.dataclass(frozen=True)
class Request:
    """What a search is asked to do, besides the problem."""

    task: str
    """The space: "shard", "replicate", "pipeline" or "hybrid" (see `check_tasks`)."""
    budget_s: float
    """The budget, counted in work at a nominal rate per second (wall time is a safety stop)."""
    seed: int
    """The seed: the same seed and budget give the same plan on any machine."""
    progress: bool = False
    """Show a progress bar on a terminal."""
    files: DQNFiles = dataclasses.field(default_factory=DQNFiles)
    """The DQN's agent and search-state files (the other searchers take none)."""


@dataclasses.dataclass(frozen=True)
class Searcher:
    """One searcher: how to run it, and the spaces it can search."""

    name: str
    """Its name, as `searcher=` and `--searcher` take it."""
    run: Callable[[Problem, Request], Plan]
    """(problem, request) -> its best plan, priced (provenance is added by `run_searcher`)."""
    tasks: frozenset[str]
    """The tasks it can search."""
    auto_task: str
    """Its task when the user says "auto": the widest space it searches well."""
    ends: bool = False
    """It ends on its own (a proof, a whole enumeration, a fixed list), so a budget of inf
    means "no time limit"; the sampling searchers (dqn, random, mcmc) refuse inf."""


def _space_searcher(name: str) -> Callable[[Problem, Request], Plan]:
    def run(problem: Problem, request: Request) -> Plan:
        try:
            found, stats = run_space_searcher(
                problem,
                name,
                request.budget_s,
                request.seed,
                request.progress,
                request.task,
                request.files,
            )
        except InfeasibleError as e:
            if e.proved or name == "ilp" or request.task not in ONE_STAGE:
                raise
            raise _why_nothing_fits(problem, request, str(e)) from None
        best = with_stats(found, stats, {"arg_roles": arg_roles(problem.graph)})
        # The DQN may end below an expert it was seeded with, and an interrupted or cut
        # short search may not have caught up with the experts yet.
        if name == "dqn" or stats.get("interrupted") or stats.get("cut_short"):
            best = no_worse_than_experts(problem, best, stats, request.task)
        return best

    return run


#: The check that explains a sampling searcher's failure gets this share of the budget,
#: in counted work: with the search's own, the call ends within budget x (1 + PROOF_SHARE)
#: plus one mesh of the check (`_leanest.search_leanest`).
PROOF_SHARE = 0.1


def _why_nothing_fits(problem: Problem, request: Request, failed: str) -> InfeasibleError:
    """A sampling searcher found nothing feasible: whether a larger budget could help (some
    plan of the space fits) or not (none does), by the leanest plan of each mesh. The check
    counts its work (PROOF_SHARE of the budget), so it answers the same on a loaded
    machine: CI once ran a tenth of a one-second budget out in wall time before the proof,
    and the answer asked for a larger budget where none could help. Its wall-clock stop is
    the whole call's (SAFETY x the budget), a safety stop only."""
    budget = request.budget_s
    found = leanest_point(problem, request.task, PROOF_SHARE * budget, SAFETY * budget)
    cluster = problem.cluster
    if found.fits:
        return InfeasibleError(
            f"{failed} Plans of this space do fit (the ilp searcher finds one): give it a "
            "larger budget, or use --searcher auto or ilp."
        )
    if not found.complete:
        return InfeasibleError(
            f"{failed} Whether any plan of this space fits is not known either (that check "
            "ran out of its share of the budget): give it a larger budget, or use --searcher "
            "auto or ilp."
        )
    need = ""
    if found.point is not None:
        need = (
            f" (the leanest needs {_size(found.memory_bytes)} per device, the limit is "
            f"{_size(cluster.memory_limit)})"
        )
    return InfeasibleError(
        f"no one-stage plan fits in memory on {cluster.devices} × {cluster.name}{need}; "
        "pipelines may: use --searcher auto (or dp), more devices, a smaller batch, or a "
        "device with more memory.",
        proved=True,
    )


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def _expert(problem: Problem, request: Request) -> Plan:
    return best_expert(problem, request.task)


def _dp(problem: Problem, request: Request, label: str = "dp") -> Plan:
    """Pipelines by the exact stage DP, and unless the task is pipelines only the one-stage
    optimum (the ILP) too; the faster feasible one wins. `label` names the searcher in
    the progress lines (dp, or auto that runs it)."""
    candidates = []
    stats: dict[str, Any] = {}
    budget_s = request.budget_s
    one_stage_proved = request.task == "pipeline"  # nothing to prove there
    try:
        if request.task != "pipeline":
            found, one = _one_stage(problem, budget_s / 2, request.progress, label)
            if found is not None:
                candidates.append(found)
            else:  # nothing fits on one stage: pipelines may
                one_stage_proved = bool(one.get("optimal"))
            # The one-stage variants priced (`_one_stage.py`), beside the DP's stats.
            stats["one_stage_variants"] = one.get("one_stage_variants", 0)
            if one.get("interrupted"):  # Ctrl-C came during the ILP: stop here too
                raise KeyboardInterrupt
        # Half the budget each when the ILP ran: counted work, not the wall time left, so
        # that the same budget gives the same plan on any machine.
        dp_budget = budget_s if request.task == "pipeline" else budget_s / 2
        with SearchProgress(request.progress, f"{label}: pipelines") as bar:
            bar.start(0)  # the DP's points are not counted ahead
            piped, dp_stats = search_dp(
                problem, dp_budget, on_point=lambda plan, best: bar.advance(best_time=best)
            )
        stats = {**stats, **dp_stats}
        if piped is not None:
            candidates.append(piped)
    except KeyboardInterrupt:
        # Ctrl-C keeps the best plan so far (checked against the experts below). Before
        # the ILP or the DP found any, the best feasible expert plan is the best so far:
        # an interrupted run is never worse than an expert either. None fits: nothing.
        stats = {**stats, "interrupted": True}
        if not candidates:
            try:
                candidates.append(best_expert(problem, request.task))
            except InfeasibleError:
                raise KeyboardInterrupt from None
    if not candidates:
        return _found_none(problem, request, stats, one_stage_proved)
    best = min(candidates, key=lambda p: p.predicted.step_time_s)
    best = with_stats(best, stats, {"arg_roles": arg_roles(problem.graph)})
    if best.decisions.get("interrupted"):
        best = no_worse_than_experts(problem, best, {"interrupted": True}, request.task)
    elif best.decisions.get("complete") is False:  # the budget cut it short
        best = no_worse_than_experts(problem, best, {"complete": False}, request.task)
    return best


def _one_stage(
    problem: Problem, budget_s: float, progress: bool, label: str
) -> tuple[Plan | None, dict[str, Any]]:
    """The one-stage candidate: the ILP's optimum of the shard space, and the fastest
    feasible variant of the points it priced with recomputation, sequence parallelism
    and ZeRO-3 (`_one_stage.py`), over `budget_s` of counted work: the ILP's first, the
    variants what it leaves. None where neither fits; the ILP's stats (its "optimal"
    proves that nothing fits without recomputation)."""
    found, stats, points = one_stage_ilp(problem, budget_s, progress, f"{label}: one stage (ilp)")
    if found is not None and not (found.predicted is not None and found.predicted.feasible):
        found = None
    if stats.get("interrupted"):
        return found, stats
    left = max(budget_s - stats.get("work", 0.0) / COLUMNS_PER_SECOND, 0.0)
    with SearchProgress(progress, f"{label}: one stage (techniques)") as bar:
        bar.start(0)  # the variants are not counted ahead
        polish = OneStagePolish(problem.cost_model, Work(left), on_variant=bar.advance)
        try:
            polished = polish.run(points)
        except KeyboardInterrupt:  # Ctrl-C keeps the best so far, and stops the search
            polished, stats = polish.best, {**stats, "interrupted": True}
    stats = {**stats, "one_stage_variants": polish.priced}
    options = [p for p in (found, polished) if p is not None]
    if not options:
        return None, stats
    best = min(options, key=lambda p: p.predicted.step_time_s)  # a tie keeps the ILP's
    return dataclasses.replace(best, name=ONE_STAGE_NAME), stats


def _found_none(
    problem: Problem, request: Request, stats: dict[str, Any], one_stage_proved: bool
) -> Plan:
    """Neither the one-stage ILP nor the stage DP found a plan that fits. A complete DP is
    no proof that no pipeline fits: it tries ZeRO and recomputation on two intra-stage
    assignments of each stage mesh (the time optimum and Megatron x data), not on the
    leanest. So the expert plans are tried, and that nothing fits is said only where it
    is proved: the state alone overflows every device (`memory_floor`)."""
    try:
        expert = best_expert(problem, request.task)
    except InfeasibleError:
        expert = None
    if expert is not None:
        found = {**stats, "fallback": f"the dp search found no plan; expert {expert.name}"}
        named = dataclasses.replace(expert, name=f"dp found none ({expert.name})")
        return with_stats(named, found, {"arg_roles": arg_roles(problem.graph)})
    cluster = problem.cluster
    where = f"on {cluster.devices} {cluster.name} devices"
    if not stats.get("complete", False):
        raise InfeasibleError(
            "the budget ran out before a feasible plan was found (the one-stage ILP or the "
            "pipeline search was cut short): give it a larger budget."
        )
    floor = memory_floor(problem)
    if floor > cluster.memory_limit:
        raise InfeasibleError(
            f"no plan of this space fits in memory {where}, with or without pipeline "
            f"stages: its parameters and optimizer state alone need {_size(floor)} per "
            "device spread over every device. Use more devices, a smaller batch, or a "
            "device with more memory.",
            proved=True,
        )
    one_stage = "none fits on one stage (proved by the ILP); " if one_stage_proved else ""
    raise InfeasibleError(
        f"no plan found that fits in memory {where}: {one_stage}the stage DP (ZeRO and "
        "rematerialization on the time-optimal and Megatron intra-stage plans) and the "
        "expert plans found no pipeline that fits, though a leaner one may. Use more "
        "devices, a smaller batch, or a device with more memory."
    )


def _auto(problem: Problem, request: Request) -> Plan:
    """The widest space with the strongest searcher of each part: the one-stage optimum
    (the ILP) and pipelines with microbatches, ZeRO and rematerialization (the stage DP),
    through `dp`; never worse than the best expert plan."""
    found: list[Plan] = []
    failure: InfeasibleError | None = None
    try:
        found.append(_dp(problem, request, "auto"))
    except InfeasibleError as e:
        failure = e
    with contextlib.suppress(InfeasibleError):  # no expert fits: dp's answer stands
        found.append(best_expert(problem, request.task))
    if not found:
        assert failure is not None
        raise _with_leanest(problem, failure)
    best = min(found, key=lambda p: p.predicted.step_time_s)
    if failure is None and found[0].decisions.get("interrupted"):
        # An expert that beats an interrupted search is still the answer of a search that
        # was stopped: the caller must hear it (the CLI saves it and exits with 130).
        best = with_stats(best, {"interrupted": True}, {})
    return best


def _with_leanest(problem: Problem, failure: InfeasibleError) -> InfeasibleError:
    """The failure, with what the leanest expert plan needs when no budget would help."""
    if not failure.proved:
        return failure
    plans = [p for p in priced_experts(problem).values() if p.predicted is not None]
    if not plans:
        return failure
    least = min(plans, key=lambda p: p.predicted.memory_bytes)
    need, limit = least.predicted.memory_bytes, problem.cluster.memory_limit
    return InfeasibleError(
        f"{failure} The leanest plan ({least.name}) needs {_size(need)} per device; "
        f"the limit is {_size(limit)}.",
        proved=True,
    )


#: Every searcher, in the order the CLI lists them. The DQN's "auto" task stays the shard
#: task: its pipeline tasks price a whole schedule per episode, and the default plan must
#: stay fast.
SEARCHERS: dict[str, Searcher] = {
    s.name: s
    for s in (
        Searcher("auto", _auto, ALL_TASKS, "hybrid", ends=True),
        Searcher("dqn", _space_searcher("dqn"), ALL_TASKS, "shard"),
        Searcher("ilp", _space_searcher("ilp"), ONE_STAGE, "shard", ends=True),
        Searcher("dp", _dp, ALL_TASKS, "hybrid", ends=True),
        Searcher("exhaustive", _space_searcher("exhaustive"), ONE_STAGE, "shard", ends=True),
        Searcher("expert", _expert, ALL_TASKS, "hybrid", ends=True),
        Searcher("random", _space_searcher("random"), ONE_STAGE, "shard"),
        Searcher("mcmc", _space_searcher("mcmc"), ONE_STAGE, "shard"),
    )
}
#: The default searcher.
AUTO_SEARCHER = "auto"


def check_searcher(searcher: str) -> str:
    """The registered name of `searcher`, or a one-line error."""
    if searcher not in SEARCHERS:
        raise AutomapError(f"unknown searcher {searcher!r}; choose one of {', '.join(SEARCHERS)}.")
    return searcher


def check_tasks(tasks: str | Sequence[str], searcher: str = AUTO_SEARCHER) -> str:
    """The space to search: "shard" (mesh, tensor sharding and ZeRO), "replicate" (data
    parallelism and ZeRO), "pipeline" (pipelines only) or "hybrid" (all of them). "auto"
    is the searcher's own (`Searcher.auto_task`)."""
    entry = SEARCHERS[check_searcher(searcher)]
    if tasks == "auto":
        return entry.auto_task
    items = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    bad = [t for t in items if t not in TASKS]
    if bad or not items:
        raise AutomapError(
            f"unknown task(s) {bad or items!r}; tasks is 'auto' or a subset of {TASKS}."
        )
    if "pipeline" in items:
        if "pipeline" not in entry.tasks:
            raise AutomapError(
                f"searcher {entry.name!r} does not search pipeline plans in automap "
                f"{__version__}; use searcher='dp' (exact stage cuts over the hybrid space) "
                "or 'expert', or leave 'pipeline' out of tasks."
            )
        return "pipeline" if len(items) == 1 else "hybrid"
    return "shard" if "shard" in items else "replicate"


def run_searcher(
    problem: Problem,
    name: str,
    budget_s: float,
    seed: int,
    progress: bool = False,
    task: str | None = None,
    agent_in: str | Path | None = None,
    agent_out: str | Path | None = None,
    resume: str | Path | None = None,
) -> Plan:
    """One searcher on a built problem: its best plan, priced, with provenance. `task`
    None is the searcher's "auto" task. `agent_in`, `agent_out` and `resume` are the
    DQN's files (see `am.plan`)."""
    name = check_searcher(name)
    budget_s = check_budget(budget_s, (name,))
    seed = check_seed(seed)
    task = check_tasks("auto", name) if task is None else task
    files = DQNFiles(*(None if f is None else Path(f) for f in (agent_in, agent_out, resume)))
    if files and name != "dqn":
        raise AutomapError(
            f"agent_in, agent_out and resume are for the dqn searcher, not {name}: "
            "use searcher='dqn' or leave them out"
        )
    if STOP.is_set():
        # Ctrl-C came before the search began, its KeyboardInterrupt lost in a callback
        # of JAX's during the capture (a weakref's or a finalizer's drops it): nothing has
        # been searched, so there is no plan to keep, as when the raise lands.
        raise KeyboardInterrupt
    start = time.perf_counter()
    best = SEARCHERS[name].run(problem, Request(task, budget_s, seed, progress, files))
    provenance = Provenance(
        searcher=name,
        seed=seed,
        search_time_s=round(time.perf_counter() - start, 3),
        version=__version__,
        fingerprint=problem.graph.fingerprint,
        cluster=problem.cluster.name,
        devices=problem.cluster.devices,
        batch=problem.graph.batch_rows,
        # A space with pipelines says what kept them from cutting between layers.
        notes=pipeline_notes(problem.graph) if task in ("pipeline", "hybrid") else (),
    )
    return dataclasses.replace(best, provenance=provenance, in_tree=problem.graph.in_tree)


def check_seed(seed: object, option: str = "seed") -> int:
    """The one rule for a seed, shared by `am.plan`, `compare` and the CLI's `--seed`: a
    whole number >= 0. NumPy's generators refuse negative seeds, so -1 would otherwise
    fail deep inside the searchers that draw from one (dqn, random, mcmc) and pass the
    others."""
    example = "--seed 0" if option.startswith("-") else f"{option}=0"
    whole = isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
    if not whole or seed < 0:
        raise AutomapError(
            f"{option} must be a whole number >= 0 (the same seed gives the same plan), got "
            f"{seed!r} (e.g. {example})."
        )
    return int(seed)


def check_budget(
    budget_s: object, searchers: Sequence[str] | None = None, option: str = "budget_s"
) -> float:
    """The one rule for a search budget, shared by `am.plan`, `compare` and the CLI's
    `--budget`: seconds > 0 (not 0, negative or NaN); inf only when every searcher in
    `searchers` ends on its own (None: any searcher may run, so inf is refused)."""
    example = "--budget 30" if option.startswith("-") else f"{option}=30"
    real = isinstance(budget_s, numbers.Real) and not isinstance(budget_s, bool)
    if not real or not budget_s > 0:  # `not >` also catches NaN
        shown = f"{budget_s:g}" if real else repr(budget_s)
        raise AutomapError(
            f"{option} is seconds of search and must be a positive number, got {shown} "
            f"(e.g. {example})."
        )
    if math.isinf(budget_s):
        ending = [n for n, s in SEARCHERS.items() if s.ends]
        endless = [s for s in (searchers or ("dqn",)) if s not in ending]
        if endless:
            raise AutomapError(
                f"{option} inf means 'run until the search ends', and the {endless[0]} "
                f"searcher samples until its budget is spent: give seconds (e.g. {example}), "
                f"or use one that ends on its own ({', '.join(ending)})."
            )
    return float(budget_s)
