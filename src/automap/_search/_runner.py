"""Running a space searcher (dqn, random, mcmc, exhaustive) on a built problem.

Every searcher explores the same `ShardSpace` under the same cost model and hands back its
best point as a plan, with the learning curve (one row per episode or evaluation) in
`plan.decisions["curve"]`. Budgets are counted in episodes or evaluations at a nominal
rate (see `_classic.EVALS_PER_SECOND`), so the same seed gives the same plan anywhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from .._axes import DATA, MODEL
from .._errors import AutomapError, InfeasibleError, SaveWarning
from .._plan import Plan
from .._space import (
    ShardSpace,
    axis_assignment,
    batch_groups,
    block_groups,
    expert_assignments,
    microbatch_counts,
)
from ..rl import CheckpointError, DQNAgent, DQNConfig, SearchCheckpoint, load_agent_state
from ..rl import search as dqn_search
from ._classic import COUNTED, SAFETY, Tracker, search_exhaustive, search_mcmc, search_random
from ._leanest import Leanest, search_leanest
from ._mdp import PipelineProcess, ShardProcess, baseline_time, make_pipeline_process
from ._one_stage import OneStagePoint
from ._problem import Problem
from ._shard_ilp import search_ilp
from ._techniques import REMATS, polish_techniques

# The DQN's budget in episodes per second of budget_s: a nominal rate, for determinism.
EPISODES_PER_SECOND = 40
# The same for the pipeline and hybrid tasks, whose episodes each price a whole pipeline
# schedule (and the hybrid's a stage DP): about a tenth of the rate.
PIPELINE_EPISODES_PER_SECOND = 4
#: The technique actions of Megatron's 2022 recipe (Korthikanti et al.): selective
#: recomputation, the stream split (where the plan offers it); an expert seed's second form.
MODERN = (REMATS.index((True, "selective")), 1)


@dataclasses.dataclass(frozen=True)
class DQNFiles:
    """The files a DQN search reads and writes besides the plan."""

    agent_in: Path | None = None
    """Warm start: the network weights of the agent saved here (a fresh replay)."""
    agent_out: Path | None = None
    """Save the trained agent here when the search ends."""
    resume: Path | None = None
    """The search state: continued from when the file exists, (re)written when the search
    ends, Ctrl-C included. The budget is the total over every run."""

    def __bool__(self) -> bool:
        return any((self.agent_in, self.agent_out, self.resume))


def run_space_searcher(
    problem: Problem,
    name: str,
    budget_s: float,
    seed: int,
    progress: bool = False,
    task: str = "shard",
    files: DQNFiles = DQNFiles(),
    label: str = "",
) -> tuple[Plan, dict[str, Any]]:
    """(best plan, search stats) for searcher `name` over the problem's space for `task`.

    Ctrl-C during the search stops it and hands back the best plan so far, with
    `stats["interrupted"] = True`; before any feasible plan is found it propagates.
    `files` (agents and search states) are for the DQN only. `label` names the search in
    its progress (default: `name`), for a searcher run as part of another.
    """
    if files and name != "dqn":
        raise AutomapError(
            f"agent files and resume are for the dqn searcher, not {name}: "
            "use searcher='dqn' or leave them out"
        )
    pipelined = task in ("pipeline", "hybrid")
    space = space_of(problem, "shard" if pipelined else task)
    if pipelined:
        if name != "dqn":
            raise AutomapError(f"the {name} searcher has no {task} task; use dqn or dp")
        with SearchProgress(progress, name) as bar:
            return _dqn_pipeline(space, task, budget_s, seed, bar, files)
    if name not in POINT_SEARCHES:
        raise AutomapError(f"no space searcher called {name!r}")
    with SearchProgress(progress, label or name) as bar:
        point, stats = POINT_SEARCHES[name](space, budget_s, seed, bar, files)
    if point is None:
        if (name == "exhaustive" and stats["complete"]) or (name == "ilp" and stats.get("optimal")):
            # Proven: no budget would help.
            raise InfeasibleError(
                f"no one-stage plan fits in memory on {problem.cluster.devices} × "
                f"{problem.cluster.name} (the {name} search covers all of it); pipelines may: "
                "use --searcher auto (or dp), more devices, a smaller batch, or a device with "
                "more memory.",
                proved=True,
            )
        raise InfeasibleError(
            f"the budget ran out before the {name} search found a feasible plan "
            f"({stats['evaluated']} tries)."
        )
    plan = space.to_plan(*point, name=name)
    return plan, stats


def space_of(problem: Problem, task: str) -> ShardSpace:
    """The one-stage space of `task` ("shard" or "replicate") over the problem."""
    return ShardSpace(problem.graph, problem.groups, problem.cluster, problem.cost_model, task=task)


def leanest_point(problem: Problem, task: str, budget_s: float, wall_s: float) -> Leanest:
    """Whether some plan of the one-stage space of `task` fits in memory, within `budget_s`
    of counted work (`_leanest.search_leanest`); `wall_s` is a safety stop only."""
    return search_leanest(space_of(problem, task), budget_s, wall_s)


def _exhaustive(space: ShardSpace, tracker: Tracker, seed: int) -> None:
    try:
        search_exhaustive(space, tracker)
    except ValueError as e:
        raise AutomapError(str(e)) from None


#: The searchers that need no learning: each walks the space, offering points to a Tracker.
CLASSIC: dict[str, Any] = {
    "random": search_random,
    "mcmc": lambda space, tracker, seed: search_mcmc(
        space, tracker, seed, start=expert_start(space)
    ),
    "exhaustive": _exhaustive,
}


def _classic(space: ShardSpace, name: str, budget_s: float, seed: int, bar: SearchProgress):
    tracker = Tracker(budget_s=budget_s)
    if name != "exhaustive":
        tracker.cover(space)
    bar.start(tracker.max_evals if name != "exhaustive" else space.size())
    tracker.on_offer = bar.advance
    CLASSIC[name](space, tracker, seed)
    curve = [
        {"episode": i, "best_time": best, "current_time": current}
        for i, best, current in tracker.curve
    ]
    stats = {
        "evaluated": tracker.evaluated,
        "time_to_best_s": round(tracker.time_to_best_s, 3),
        "curve": curve,
    }
    if tracker.interrupted:
        stats["interrupted"] = True
    if tracker.exhausted:  # every point seen: the best of them is the space's optimum
        stats["exhausted"] = True
    if name == "exhaustive":
        stats["complete"] = tracker.complete and not tracker.interrupted
        stats["space_points"] = space.size()
    return tracker.best, stats


def one_stage_ilp(
    problem: Problem, budget_s: float, progress: bool = False, label: str = "ilp"
) -> tuple[Plan | None, dict[str, Any], list[OneStagePoint]]:
    """The ILP over the shard space, for the dp searcher: its plan (None where it found
    none: `stats["optimal"]` then proves that no plan of the space fits), its stats, and
    every point it priced, feasible or not (the one-stage polish starts from them)."""
    space = space_of(problem, "shard")
    priced: list[OneStagePoint] = []

    def keep(point, cost) -> None:
        mesh, assignment = space.meshes[point[0]], space.assignment(point[1])
        priced.append(OneStagePoint(mesh, assignment, point[2], cost))

    with SearchProgress(progress, label) as bar:
        point, stats = _ilp(space, budget_s, bar, keep)
    plan = None if point is None else space.to_plan(*point, name="ilp")
    return plan, stats, priced


def _ilp(space: ShardSpace, budget_s: float, bar: SearchProgress, on_priced=None):
    """The ILP over the whole budget. Cut short before any feasible point (a time-out that
    proved nothing, meshes too large for the budget), it falls back to the best expert
    point of the space, and at worst to the replicated plan when that fits.
    `on_priced(point, cost)` follows each point the ILP priced, feasible or not."""

    def solved(point, cost, best_time) -> None:
        bar.advance(point, cost, best_time)
        if point is not None and on_priced is not None:
            on_priced(point, cost)

    bar.start(sum(len([z for z in space.zero_options(m) if z != 1]) for m in space.meshes))
    point, stats = search_ilp(space, time_limit_s=budget_s, on_solve=solved)
    if point is None and stats.get("cut_short"):
        replicated = (0, (0,) * len(space.units), 0)
        for fallback, name in ((expert_start(space), "expert"), (replicated, "replicated")):
            if (
                fallback is not None
                and space.evaluate(*fallback[:2], zero_stage=fallback[2]).feasible
            ):
                return fallback, {**stats, "fallback": name}
    return point, stats


def expert_start(space: ShardSpace):
    """MCMC starts from the best expert plan that is a point of the space, when there is one."""
    process = ShardProcess(space, 1.0)
    best, best_time = None, float("inf")
    for mesh, assignment, zero in expert_assignments(
        space.graph, space.groups, space.cluster
    ).values():
        decisions = process.decisions_for(mesh, assignment, zero)
        if decisions is None:
            continue
        point = process.to_point(decisions)
        cost = space.evaluate(point[0], point[1], zero_stage=point[2])
        if cost.feasible and cost.step_time_s < best_time:
            best, best_time = point, cost.step_time_s
    return best


def search_dqn(
    space: ShardSpace, budget_s: float, seed: int, bar: SearchProgress, files: DQNFiles = DQNFiles()
):
    process = ShardProcess(space, baseline_time(space))
    seeds = expert_seeds(process)
    seen: set[tuple[int, tuple[int, ...], int]] = set()
    size = space.exact_size(cap=COUNTED)

    def exhausted(decisions: tuple[int, ...]) -> bool:
        # Episodes are counted work: the same seed stops at the same episode anywhere.
        point = process.to_point(decisions)
        if space.contains(point):
            seen.add(point)
        return len(seen) >= size

    point, stats = _run_dqn(
        process, space, seeds, budget_s, seed, bar, EPISODES_PER_SECOND, files,
        exhausted=None if size is None else exhausted,
    )  # fmt: skip
    if size is not None and len(seen) >= size:
        stats["exhausted"] = True
    return (None if point is None else process.to_point(point)), stats


def expert_seeds(process) -> list[tuple[int, ...]]:
    """The DQN's seed episodes on the shard task: the decisions of every expert plan that is
    a point of the space."""
    space, seeds = process.space, []
    for mesh, assignment, zero in expert_assignments(
        space.graph, space.groups, space.cluster
    ).values():
        decisions = process.decisions_for(mesh, assignment, zero)
        if decisions is not None and decisions not in seeds:
            seeds.append(decisions)
    return seeds


def _dqn_pipeline(
    space: ShardSpace, task: str, budget_s: float, seed: int, bar: SearchProgress, files: DQNFiles
):
    """The DQN on the pipeline or hybrid task: its best plan (priced by the pipeline cost
    model) and stats. Seeded with the expert recipes: the shard experts on one stage, and
    data parallel or Megatron x data stages at every power-of-two stage count."""
    process = make_pipeline_process(space, task, baseline_time(space))
    seeds: list[tuple[int, ...]] = []
    if isinstance(process, PipelineProcess):
        # Each stage count with its quick-picked stages, the most microbatches, balanced cuts.
        for k, S in enumerate(process.stage_choices):
            if S & (S - 1) == 0:
                seeds.append(process.seed(k))
    else:
        for mesh, assignment, zero in expert_assignments(
            space.graph, space.groups, space.cluster
        ).values():
            seeds.append(process.decisions_for(1, mesh, assignment, zero, 1))
            # And as Megatron's 2022 recipe runs it: the stream split, selective recompute.
            seeds.append(process.decisions_for(1, mesh, assignment, zero, 1, MODERN))
        seeds.extend(recipe_seeds(process))
    seeds = list(dict.fromkeys(s for s in seeds if s is not None))
    rate = PIPELINE_EPISODES_PER_SECOND
    decisions, stats = _run_dqn(process, space, seeds, budget_s, seed, bar, rate, files)
    if decisions is None:
        raise InfeasibleError(
            f"the budget ran out before the dqn search found a feasible {task} plan "
            f"({stats['evaluated']} episodes)."
        )
    plan = process.to_plan(decisions, name="dqn")
    polished = _polished(process, plan)
    stats["techniques_polished"] = polished is not plan
    return polished, stats


def _polished(process, plan: Plan) -> Plan:
    """The DQN's best pipeline through the dp searcher's last step (`polish_techniques`).
    The techniques are actions of the agent's episodes, but a search of a few dozen
    episodes seldom tries each on its best point (one on/off among a dozen decisions, a
    fraction of a percent of the step on small models): the polish tries them all there,
    in a fixed order, and keeps the plan where none prices faster."""
    if len(plan.stages) < 2:
        return plan
    pricer = process.pricer
    return polish_techniques(process.model, plan, tuple(pricer.cands[i] for i in pricer.aligned))


def recipe_seeds(process) -> list[tuple[int, ...] | None]:
    """Hybrid decisions of the experts' recipes: every power-of-two S, stages data parallel
    or Megatron over the node x data, the most microbatches, ZeRO off; on one stage
    Megatron at every power-of-two tensor size within the node, ZeRO off and (over data)
    ZeRO-2, as DeepSpeed adds it; each with no technique and with Megatron's 2022 ones
    (`MODERN`). One stage's were the shard experts' alone, and the agent did not find
    Korthikanti's 22B row's data 2 x model 4 with ZeRO-2 from them (dp's plan, 0.94 of the
    published configuration's step)."""

    groups, cluster, out = process.space.groups, process.space.cluster, []
    node = cluster.devices_per_node
    for S in process.stage_choices:
        per = cluster.devices // S
        if S & (S - 1):
            continue
        tps = {1, min(node, per)}
        if S == 1:
            tps = {1 << k for k in range(min(node, per).bit_length())}
        for tp in sorted(tps):
            mesh = {k: v for k, v in ((DATA, per // tp), (MODEL, tp)) if v > 1} or {DATA: 1}
            assignment = {
                **axis_assignment(batch_groups(groups), DATA, per // tp),
                **axis_assignment(block_groups(groups), MODEL, tp),
            }
            if S == 1:
                m, zeros = 1, (0, 2) if per // tp > 1 else (0,)
            else:
                ms = microbatch_counts(
                    process.pricer.batch, per // tp, S, process.pricer.microbatching
                )
                m, zeros = ms[-1], (0,)
            for zero, techniques in itertools.product(zeros, ((), MODERN)):
                out.append(process.decisions_for(S, mesh, assignment, zero, m, techniques))
    return out


def _run_dqn(
    process,
    space: ShardSpace,
    seeds,
    budget_s: float,
    seed: int,
    bar: SearchProgress,
    rate: float,
    files: DQNFiles = DQNFiles(),
    exhausted=None,
):
    """(the best feasible decisions or None, stats) of a DQN search over `process`, a
    decision process over `space` (or over pipelines of it)."""

    episodes = max(len(seeds) + 1, int(budget_s * rate))
    config = DQNConfig(max_episodes=episodes)
    # What a saved search state must have been made for to be resumed here.
    key = {
        "program": space.graph.fingerprint,
        "cluster": f"{space.cluster.devices} x {space.cluster.name}",
        "process": type(process).__name__,
        "seed": seed,
    }
    agent = resume = None
    try:
        if files.resume is not None and files.resume.exists():
            resume = SearchCheckpoint.load(files.resume)
            resume.check_key(key, files.resume)
        elif files.agent_in is not None:
            agent = DQNAgent(process.obs_dim, process.n_actions, config, seed=seed)
            agent.from_state_dict(load_agent_state(files.agent_in), weights_only=True)
    except CheckpointError as err:
        raise AutomapError(str(err)) from None
    except ValueError as err:  # the agent's network does not fit this process
        raise AutomapError(
            f"the agent in {files.agent_in} does not fit this search ({err}); "
            "train one with this version and task (agent_out= / --save-agent), or leave it out"
        ) from None

    bar.start(episodes)
    if resume is not None:
        bar.advance_to(min(resume.episode, episodes))

    def on_episode(episode, best, current, exploration, loss) -> None:
        bar.advance(best_time=best)

    result = dqn_search(
        process,
        budget_s=SAFETY * budget_s,
        seed=seed,
        config=None if agent is not None else config,
        agent=agent,
        seed_episodes=seeds,
        on_episode=on_episode,
        resume=resume,
        exhausted=exhausted,
    )
    if files.resume is not None and result.checkpoint is not None:
        checkpoint = dataclasses.replace(result.checkpoint, key=key)
        _save_aside("search state", files.resume, checkpoint.save)
    if files.agent_out is not None and result.agent is not None:
        _save_aside("agent", files.agent_out, result.agent.save)
    stats = {
        "evaluated": result.episodes,
        "episodes": result.episodes,
        "time_to_best_s": round(result.time_to_best_s, 3),
        "curve": result.curve,
    }
    if result.interrupted:
        if not result.best_feasible:
            # Stopped before any plan fit in memory: nothing worth keeping.
            raise KeyboardInterrupt
        stats["interrupted"] = True
    if not result.best_feasible:
        return None, stats
    return result.best_decisions, stats


def _save_aside(what: str, path: Path, save) -> None:
    """`save(path)`, a file besides the plan: a failure (a full disk) is a SaveWarning, not
    an error that would throw away the search and its plan."""
    try:
        save(path)
    except OSError as e:
        warnings.warn(
            f"the {what} could not be written to {path} ({e.strerror or e}); the plan "
            f"stands, but not the {what}",
            SaveWarning,
            stacklevel=2,
        )


class SearchProgress:
    """A Rich progress bar with the best step time so far, or nothing when quiet. Off a
    terminal (a log, a batch job) it prints a plain line to stderr every LOG_EVERY_S
    seconds instead, so that a long search is seen to be alive. A clock thread writes
    those lines: the ILP's solves, the stage DP's points and the polish advance rarely
    (one ILP solve may take the whole budget), so lines written only on an advance left
    `auto`, `dp` and `ilp` silent for a whole 25 s search (issue 28)."""

    LOG_EVERY_S = 10.0

    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name = enabled, name
        self._bar = self._task = None
        self._log = None  # the stderr console when logging lines off a terminal
        self._done, self._total, self._best = 0, 0, "—"
        self._start = self._last = time.perf_counter()
        self._lock = threading.Lock()  # one line per interval, from the clock or an advance
        self._stop = threading.Event()
        self._clock: threading.Thread | None = None

    def __enter__(self) -> SearchProgress:
        from rich.console import Console

        # On stderr: stdout is for the answer (a table, or JSON a script reads). Only on a
        # terminal: in a log file a live bar is noise (and leaves a stray blank line).
        console = Console(stderr=True)
        if self.enabled and console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("best {task.fields[best]}"), transient=True, console=console,
            )  # fmt: skip
            self._bar.__enter__()
        elif self.enabled:
            self._log = console
            if self.LOG_EVERY_S > 0:  # 0 (tests): a line on every advance, no clock needed
                self._clock = threading.Thread(target=self._tick, daemon=True)
                self._clock.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(max(self._last + self.LOG_EVERY_S - time.perf_counter(), 0.0)):
            self._maybe_log()

    def start(self, total: int) -> None:
        """`total` steps to come; 0 when not known ahead (the stage DP's points)."""
        self._total = total
        if self._bar is not None:
            self._task = self._bar.add_task(self.name, total=total or None, best="—")

    def advance_to(self, completed: int) -> None:
        self._done = completed
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=completed)
        self._maybe_log()

    def advance(self, point: Any = None, cost: Any = None, best_time: float | None = None) -> None:
        if self._bar is None and self._log is None:
            return
        fields = {}
        if best_time is not None and best_time < float("inf"):
            fields["best"] = f"{best_time * 1e3:.2f} ms"
        elif cost is not None and getattr(cost, "feasible", False):
            fields["best"] = f"{cost.step_time_s * 1e3:.2f} ms (last feasible)"
        self._done += 1
        self._best = fields.get("best", self._best)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, **fields)
        self._maybe_log()

    def _maybe_log(self) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._log is None or now - self._last < self.LOG_EVERY_S:
                return
            self._last = now
            total = f"/{self._total}" if self._total else ""
            self._log.print(
                f"{self.name}: {self._done}{total} evaluated, best {self._best}, "
                f"{now - self._start:.0f} s",
                highlight=False, soft_wrap=True, markup=False,
            )  # fmt: skip

    def __exit__(self, *exc: Any) -> None:
        if self._clock is not None:
            self._stop.set()
            self._clock.join()
        if self._bar is not None:
            self._bar.__exit__(*exc)


def with_stats(plan: Plan, stats: dict[str, Any], extra: dict[str, Any]) -> Plan:
    return dataclasses.replace(plan, decisions={**plan.decisions, **extra, **stats})


#: (space, budget_s, seed, progress bar, DQN files) -> (best point or None, stats), by name.
POINT_SEARCHES: dict[str, Any] = {
    "dqn": search_dqn,
    "ilp": lambda space, budget_s, seed, bar, files: _ilp(space, budget_s, bar),
    **{
        name: lambda space, budget_s, seed, bar, files, name=name: _classic(
            space, name, budget_s, seed, bar
        )
        for name in CLASSIC
    },
}
