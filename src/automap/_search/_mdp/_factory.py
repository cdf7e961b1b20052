"""Decision processes for a program: the one each exploration task explores, and the
yardstick its rewards are measured against.

The space (`automap._space`) knows nothing of the processes that walk it; this module
builds them from a captured program, for the DQN search and for `PlanningEnv` users.
"""

from __future__ import annotations

from typing import Any

from ..._cluster import Cluster
from ..._cost import CostModel
from ..._graph import Graph
from ..._groups import build_groups
from ..._space import SPACE_TASKS as SHARD_TASKS
from ..._space import Pruning, ShardSpace, expert_plans_for
from ...rl import PlanningEnv
from ._hybrid import make_pipeline_process
from ._shard_process import ShardProcess


def make_process(graph: Graph, cluster: Cluster, task: str = "shard", pruning: Pruning = Pruning()):
    """A DecisionProcess for the DQN (automap.rl) over this program's space for `task`."""
    pipelined = task in ("pipeline", "hybrid")
    if task not in SHARD_TASKS and not pipelined:
        raise ValueError(
            f"task {task!r} has no decision process; available: "
            f"{', '.join(SHARD_TASKS)}, pipeline, hybrid"
        )
    groups = build_groups(graph, layer_grouping=pruning.layer_grouping)
    cost_model = CostModel(graph, cluster, groups)
    space = ShardSpace(
        graph, groups, cluster, cost_model, pruning, task="shard" if pipelined else task
    )
    if pipelined:
        return make_pipeline_process(space, task, baseline_time(space))
    return ShardProcess(space, baseline_time(space))


def baseline_time(space: ShardSpace) -> float:
    """The reward's yardstick: data parallelism's step time, else the best expert's, else
    the plan with nothing split."""
    plans = expert_plans_for(space.graph, space.groups, space.cluster)
    costs = {name: space.cost_model.estimate(p) for name, p in plans.items()}
    dp = costs.get("data_parallel")
    if dp is not None and dp.feasible:
        return dp.step_time_s
    feasible = [c.step_time_s for c in costs.values() if c.feasible]
    if feasible:
        return min(feasible)
    return space.evaluate(0, [0] * len(space.units)).step_time_s


def planning_env(graph: Graph, cluster: Cluster, task: str = "shard", **kwargs: Any) -> PlanningEnv:
    """The Gymnasium environment of one exploration task ("shard", "replicate",
    "pipeline", "hybrid") on one program and cluster; `kwargs` go to `PlanningEnv`."""
    return PlanningEnv(make_process(graph, cluster, task), **kwargs)
