"""One planning problem (a captured program, its groups, a cluster and a cost model), and
what every searcher measures itself against: the priced expert plans.

Input: a step function and its arguments, or a captured Graph. Output: a `Problem` that
the searchers (`_registry.py`) take. DESIGN.md, "Searchers".
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._axes import DATA
from .._capture import capture
from .._cluster import Cluster
from .._cost import CostModel
from .._errors import AutomapError, InfeasibleError
from .._graph import Graph, Role
from .._groups import Groups, build_groups
from .._plan import Cost, Plan
from .._space import expert_plans_for, pipeline_experts


@dataclasses.dataclass(frozen=True)
class Problem:
    """One planning problem: the captured program, its groups and a cost model."""

    graph: Graph
    groups: Groups
    cluster: Cluster
    cost_model: CostModel
    # Priced expert plans by `pipelines`, filled by `priced_experts`: a search asks for
    # them several times (dp, the auto searcher, the no-worse-than-experts checks), and
    # pricing the pipeline experts of a large model takes seconds.
    expert_cache: dict[bool, dict[str, Plan]] = dataclasses.field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @classmethod
    def build(
        cls, step_fn: Callable, args: Sequence[Any], cluster: Cluster, roles: Any = None
    ) -> Problem:
        if not isinstance(cluster, Cluster):
            raise AutomapError(_cluster_hint(cluster))
        graph = capture(step_fn, *args, roles=roles)
        if not graph.inputs:
            raise AutomapError(
                "the step takes no array arguments, so there is nothing to split: pass the "
                "parameters, optimizer state and batch as arguments (not closed over)."
            )
        groups = build_groups(graph)
        return cls(graph, groups, cluster, CostModel(graph, cluster, groups))

    def estimate(self, plan: Plan) -> Cost:
        return self.cost_model.estimate(plan)

    def priced(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, predicted=self.estimate(plan))


def _cluster_hint(cluster: Any) -> str:
    if isinstance(cluster, str):
        return (
            f"cluster must be a Cluster, not the string {cluster!r}: use "
            f"am.Cluster.preset({cluster!r}, devices=8) or am.Cluster.from_file(path)."
        )
    return (
        f"cluster must be a Cluster, got {type(cluster).__name__}: use "
        "am.Cluster.preset('a100', devices=8) or am.Cluster.from_file(path)."
    )


def priced_experts(problem: Problem, pipelines: bool = True) -> dict[str, Plan]:
    """Every expert plan that applies, priced, with the problem's provenance; infeasible
    ones kept (marked by `predicted.feasible`). Computed once per problem."""
    if pipelines not in problem.expert_cache:
        problem.expert_cache[pipelines] = _price_experts(problem, pipelines)
    return dict(problem.expert_cache[pipelines])


def _price_experts(problem: Problem, pipelines: bool) -> dict[str, Plan]:
    plans = expert_plans_for(problem.graph, problem.groups, problem.cluster, problem.estimate)
    if pipelines:
        plans.update(
            pipeline_experts(problem.graph, problem.groups, problem.cluster, problem.estimate)
        )
    tree = problem.graph.in_tree
    out = {}
    for name, p in plans.items():
        # The pipeline experts come priced by this problem's estimate already (they pick
        # stage counts by it); pricing a 1T GPT's pipeline again took seconds.
        p = p if p.predicted is not None else problem.priced(p)
        provenance = dataclasses.replace(
            p.provenance,
            searcher="expert",
            fingerprint=problem.graph.fingerprint,
            cluster=problem.cluster.name,
            devices=problem.cluster.devices,
            batch=problem.graph.batch_rows,
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


def best_expert(problem: Problem, task: str = "shard") -> Plan:
    """The fastest feasible expert plan of the task's space."""
    plans = priced_experts(problem, pipelines=task in ("pipeline", "hybrid"))
    if task == "replicate":  # data parallelism and ZeRO only
        plans = {k: p for k, p in plans.items() if set(p.mesh) == {DATA}}
    elif task == "pipeline":
        plans = {k: p for k, p in plans.items() if p.pipelined}
    feasible = [p for p in plans.values() if p.predicted is not None and p.predicted.feasible]
    if not feasible:
        raise InfeasibleError(infeasible_message(problem, plans))
    return min(feasible, key=lambda p: p.predicted.step_time_s if p.predicted else math.inf)


def memory_floor(problem: Problem) -> float:
    """Bytes per device no plan of any kind holds less of: the parameters and optimizer
    state its step reads, each at least once somewhere, spread evenly over every device
    (no layout, ZeRO stage or pipeline divides a tensor by more than the device count).
    Above the memory limit it proves that nothing fits, whatever a search tried."""
    graph, consumers = problem.graph, problem.graph.consumers()
    state = sum(
        graph.tensors[leaf.tensor].nbytes
        for role in (Role.PARAM, Role.OPT_STATE)
        for leaf in graph.leaves(role)
        if consumers[leaf.tensor]
    )
    return state / problem.cluster.devices


def no_worse_than_experts(problem: Problem, plan: Plan, stats: dict, task: str) -> Plan:
    """The best expert plan of the task when the search found nothing better (the DQN
    always; other searchers when Ctrl-C stopped them early)."""
    try:
        expert = best_expert(problem, task)
    except InfeasibleError:
        return plan
    if expert.predicted.step_time_s < plan.predicted.step_time_s:
        return dataclasses.replace(
            expert, name=f"{plan.name} ({expert.name})", decisions={**expert.decisions, **stats}
        )
    return plan


def infeasible_message(problem: Problem, plans: Mapping[str, Plan]) -> str:
    """Why no expert plan is returned: none applies, or none fits (with the leanest's need)."""
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
