"""The public entry points: plan, estimate, expert_plans.

Each captures the step once, builds its linkage groups and a cost model, and hands them to
a searcher. The heavy parts live in their own modules; this one only wires them together.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._capture import capture
from ._cluster import Cluster
from ._cost import CostModel
from ._errors import AutomapError, InfeasibleError, PlanError
from ._expert import expert_plans_for
from ._graph import Graph
from ._linkage import Groups, build_groups
from ._plan import Cost, Plan, Provenance
from ._search import check_budget
from ._version import __version__

SEARCHERS = ("dqn", "ilp", "dp", "exhaustive", "expert", "random", "mcmc")
TASKS = ("shard", "replicate", "pipeline")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One planning problem: the captured program, its groups and a cost model."""

    graph: Graph
    groups: Groups
    cluster: Cluster
    cost_model: CostModel

    @classmethod
    def build(
        cls, step_fn: Callable, args: Sequence[Any], cluster: Cluster, roles: Any = None
    ) -> Problem:
        graph = capture(step_fn, *args, roles=roles)
        groups = build_groups(graph)
        return cls(graph, groups, cluster, CostModel(graph, cluster, groups))

    def estimate(self, plan: Plan) -> Cost:
        return self.cost_model.estimate(plan)

    def priced(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, predicted=self.estimate(plan))


def plan(
    step_fn: Callable,
    *args: Any,
    cluster: Cluster,
    searcher: str = "auto",
    tasks: str | Sequence[str] = "auto",
    budget_s: float = 60.0,
    seed: int = 0,
    roles: Any = None,
    origin: Mapping[str, Any] | None = None,
    progress: bool = False,
    agent_in: str | Path | None = None,
    agent_out: str | Path | None = None,
    resume: str | Path | None = None,
) -> Plan:
    """Find a fast feasible plan for `step_fn(*args)` on `cluster`.

    `progress=True` shows a progress bar with the best step time so far. Ctrl-C stops the
    search and returns the best plan so far, with `plan.decisions["interrupted"] = True`
    (never worse than the best expert plan); before anything feasible is found it raises.

    `budget_s` is seconds of search, counted as work at a nominal rate (the same seed and
    budget give the same plan on any machine); it must be > 0. `float("inf")` means no
    time limit, for the searchers that end on their own (ilp, exhaustive, dp, expert: a
    proof, the whole space); dqn, random, mcmc and "auto" sample until the budget is spent,
    and refuse it.

    `searcher="auto"` picks the strongest searcher this version has. `origin` records
    what the plan was made for (zoo model and overrides, or an `--fn` path) so that
    `automap apply plan.json` can rebuild the step.

    The DQN only: `agent_in` warm-starts the search from the network of an agent saved by
    `agent_out` (on another model, say); `resume` is a search-state file, continued from
    when it exists and rewritten when the search ends (Ctrl-C included), with `budget_s`
    the total over every run: the same seed then gives the plan of one unbroken search.
    """
    name = _check_searcher(searcher)
    budget_s = check_budget(budget_s, (searcher,))
    task = _check_tasks(tasks, name)
    start = time.perf_counter()
    problem = Problem.build(step_fn, args, cluster, roles)
    best = run_searcher(problem, name, budget_s, seed, progress, task, agent_in, agent_out, resume)
    # The whole call, capture included: what the user waited for.
    provenance = dataclasses.replace(
        best.provenance,
        search_time_s=round(time.perf_counter() - start, 3),
        **dict(origin or {}),
    )
    return dataclasses.replace(best, provenance=provenance)


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
    None is the searcher's widest: "hybrid" for dp and expert, "shard" for the others.
    `agent_in`, `agent_out` and `resume` are the DQN's files (see `plan`)."""
    name = _check_searcher(name)
    budget_s = check_budget(budget_s, (name,))
    task = _check_tasks("auto", name) if task is None else task
    from ._searchers import DQNFiles

    files = DQNFiles(*(None if f is None else Path(f) for f in (agent_in, agent_out, resume)))
    if files and name != "dqn":
        raise AutomapError(
            f"agent_in, agent_out and resume are for the dqn searcher, not {name}: "
            "use searcher='dqn' or leave them out"
        )
    start = time.perf_counter()
    if name == "expert":
        best = _best_expert(problem, task)
    elif name == "dp":
        best = _hybrid_dp(problem, budget_s, task)
        if best.decisions.get("interrupted"):
            best = _no_worse_than_experts(problem, best, {"interrupted": True}, task)
        elif best.decisions.get("complete") is False:  # the budget cut it short
            best = _no_worse_than_experts(problem, best, {"complete": False}, task)
    else:
        from ._searchers import run_space_searcher, with_stats

        found, stats = run_space_searcher(problem, name, budget_s, seed, progress, task, files)
        best = with_stats(found, stats, {"arg_roles": arg_roles(problem.graph)})
        # An interrupted or cut short search may not have caught up with the experts yet.
        if name == "dqn" or stats.get("interrupted") or stats.get("cut_short"):
            best = _no_worse_than_experts(problem, best, stats, task)
    provenance = Provenance(
        searcher=name,
        seed=seed,
        search_time_s=round(time.perf_counter() - start, 3),
        version=__version__,
        fingerprint=problem.graph.fingerprint,
        cluster=problem.cluster.name,
        devices=problem.cluster.devices,
    )
    return dataclasses.replace(best, provenance=provenance, in_tree=problem.graph.in_tree)


def estimate(
    step_fn: Callable, *args: Any, plan: Plan, cluster: Cluster, roles: Any = None
) -> Cost:
    """The cost model's prediction for `plan` applied to `step_fn(*args)` on `cluster`."""
    problem = Problem.build(step_fn, args, cluster, roles)
    _check_fits(problem.graph, plan)
    return problem.estimate(plan)


def expert_plans(
    step_fn: Callable, *args: Any, cluster: Cluster, roles: Any = None
) -> dict[str, Plan]:
    """The hand-written plans that apply to this step (data_parallel, zero1-3, megatron,
    megatron_dp, owt for a CNN, gpipe_uniform, megatron_3d), each with its predicted cost;
    infeasible ones are kept, marked by `predicted.feasible`."""
    problem = Problem.build(step_fn, args, cluster, roles)
    return _priced_experts(problem)


def _priced_experts(problem: Problem, pipelines: bool = True) -> dict[str, Plan]:
    plans = expert_plans_for(problem.graph, problem.groups, problem.cluster, problem.estimate)
    if pipelines:
        from ._pipeline._experts import pipeline_experts

        plans.update(
            pipeline_experts(problem.graph, problem.groups, problem.cluster, problem.estimate)
        )
    tree = problem.graph.in_tree
    out = {}
    for name, p in plans.items():
        p = problem.priced(p)
        provenance = dataclasses.replace(
            p.provenance,
            searcher="expert",
            fingerprint=problem.graph.fingerprint,
            cluster=problem.cluster.name,
            devices=problem.cluster.devices,
        )
        decisions = {**p.decisions, "arg_roles": arg_roles(problem.graph)}
        out[name] = dataclasses.replace(p, provenance=provenance, in_tree=tree, decisions=decisions)
    return out


def arg_roles(graph: Graph) -> dict[str, str]:
    """The role of each positional argument (its leaves' most common role), for reports."""
    counts: dict[int, Counter[str]] = {}
    for leaf in graph.inputs:
        counts.setdefault(leaf.arg_index, Counter())[leaf.role.value] += 1
    return {str(i): c.most_common(1)[0][0] for i, c in sorted(counts.items())}


def _best_expert(problem: Problem, task: str = "shard") -> Plan:
    plans = _priced_experts(problem, pipelines=task in ("pipeline", "hybrid"))
    if task == "replicate":  # data parallelism and ZeRO only
        plans = {k: p for k, p in plans.items() if set(p.mesh) == {"data"}}
    elif task == "pipeline":
        plans = {k: p for k, p in plans.items() if len(p.stages) > 1}
    feasible = [p for p in plans.values() if p.predicted is not None and p.predicted.feasible]
    if not feasible:
        raise InfeasibleError(_infeasible_message(problem, plans))
    return min(feasible, key=lambda p: p.predicted.step_time_s if p.predicted else math.inf)


def _no_worse_than_experts(problem: Problem, plan: Plan, stats: dict, task: str) -> Plan:
    """The best expert plan of the task when the search found nothing better (the DQN
    always; other searchers when Ctrl-C stopped them early)."""
    try:
        expert = _best_expert(problem, task)
    except InfeasibleError:
        return plan
    if expert.predicted.step_time_s < plan.predicted.step_time_s:
        return dataclasses.replace(
            expert, name=f"{plan.name} ({expert.name})", decisions={**expert.decisions, **stats}
        )
    return plan


def _infeasible_message(problem: Problem, plans: Mapping[str, Plan]) -> str:
    if not plans:
        return (
            "no expert plan applies to this program on "
            f"{problem.cluster.devices} devices: no batch dimension or block dimension divides "
            "by the device count. Use a batch size divisible by the device count."
        )
    least = min(plans.values(), key=lambda p: p.predicted.memory_bytes if p.predicted else math.inf)
    need = least.predicted.memory_bytes if least.predicted else math.nan
    return (
        f"no plan fits in memory: the leanest ({least.name}) needs {need / 1e9:.1f} GB per "
        f"device, the limit is {problem.cluster.memory_limit / 1e9:.1f} GB on "
        f"{problem.cluster.name}. Use more devices, a smaller batch, or a larger device."
    )


def _check_searcher(searcher: str) -> str:
    if searcher == "auto":
        return "dqn"
    if searcher not in SEARCHERS:
        raise AutomapError(
            f"unknown searcher {searcher!r}; choose one of {', '.join(SEARCHERS)} (or 'auto')."
        )
    return searcher


#: Searchers whose space holds pipeline plans (the others search one stage).
PIPELINE_SEARCHERS = ("dp", "expert", "dqn")
#: Searchers whose "auto" task is the hybrid space. The DQN's stays the shard task: its
#: pipeline tasks price a whole schedule per episode, and the default plan must stay fast.
AUTO_HYBRID = ("dp", "expert")


def _check_tasks(tasks: str | Sequence[str], searcher: str = "dqn") -> str:
    """The space to search: "shard" (mesh, tensor sharding and ZeRO), "replicate" (data
    parallelism and ZeRO), "pipeline" (pipelines only) or "hybrid" (all of them). "auto"
    is the widest space the searcher has."""
    if tasks == "auto":
        return "hybrid" if searcher in AUTO_HYBRID else "shard"
    items = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    bad = [t for t in items if t not in TASKS]
    if bad or not items:
        raise AutomapError(
            f"unknown task(s) {bad or items!r}; tasks is 'auto' or a subset of {TASKS}."
        )
    if "pipeline" in items:
        if searcher not in PIPELINE_SEARCHERS:
            raise AutomapError(
                f"searcher {searcher!r} does not search pipeline plans in automap "
                f"{__version__}; use searcher='dp' (exact stage cuts over the hybrid space) "
                "or 'expert', or leave 'pipeline' out of tasks."
            )
        return "pipeline" if len(items) == 1 else "hybrid"
    return "shard" if "shard" in items else "replicate"


def _hybrid_dp(problem: Problem, budget_s: float, task: str) -> Plan:
    """The dp searcher: pipelines by the exact stage DP, and for the hybrid task the
    one-stage optimum (the ILP) too; the faster feasible one wins."""
    from ._pipeline._search import search_dp
    from ._searchers import run_space_searcher, with_stats

    candidates = []
    stats: dict[str, Any] = {}
    try:
        if task != "pipeline":
            try:
                found, one = run_space_searcher(problem, "ilp", budget_s / 2, 0, False, "shard")
            except InfeasibleError:
                found, one = None, {}  # nothing fits on one stage: pipelines may
            if found is not None and found.predicted is not None and found.predicted.feasible:
                candidates.append(dataclasses.replace(found, name="dp (one stage, ilp)"))
            if one.get("interrupted"):  # Ctrl-C came during the ILP: stop here too
                raise KeyboardInterrupt
        # Half the budget each when the ILP ran: counted work, not the wall time left, so
        # that the same budget gives the same plan on any machine.
        piped, stats = search_dp(problem, budget_s if task == "pipeline" else budget_s / 2)
        if piped is not None:
            candidates.append(piped)
    except KeyboardInterrupt:
        # Ctrl-C keeps the best plan so far (`run_searcher` then checks it against the
        # experts); before any, it propagates.
        if not candidates:
            raise
        stats = {**stats, "interrupted": True}
    if not candidates:
        raise InfeasibleError(
            f"no plan fits in memory on {problem.cluster.devices} {problem.cluster.name} "
            "devices, with or without pipeline stages (ZeRO and rematerialization tried). "
            "Use more devices, a smaller batch, or a larger device."
        )
    best = min(candidates, key=lambda p: p.predicted.step_time_s)
    return with_stats(best, stats, {"arg_roles": arg_roles(problem.graph)})


def _check_fits(graph: Graph, plan: Plan) -> None:
    fp = plan.provenance.fingerprint
    if fp and fp != graph.fingerprint:
        raise PlanError(
            f"plan {plan.name or ''!s} was made for another program (fingerprint {fp[:12]}, "
            f"this one is {graph.fingerprint[:12]}): re-plan for this step function."
        )
    paths = {leaf.path for leaf in graph.inputs}
    missing = sorted(paths - set(plan.specs))
    extra = sorted(set(plan.specs) - paths)
    if missing or extra:
        raise PlanError(
            "plan does not match this program's inputs: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}. "
            "Re-plan for this step function."
        )
