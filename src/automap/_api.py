"""The public entry points: plan, estimate, expert_plans.

Each captures the step once into a `Problem` (the program, its linkage groups and a cost
model) and hands it to a searcher from the registry (`_search/_registry.py`). The heavy
parts live in the stage folders; this module only wires them together.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._axes import DATA
from ._cluster import Cluster
from ._errors import PlanError, PriceWarning
from ._graph import Graph
from ._groups import sequence_as_recorded, zero_mismatch
from ._plan import Cost, Plan, Provenance
from ._run import other_program
from ._search import (
    SEARCHERS,
    Problem,
    arg_roles,
    check_budget,
    check_searcher,
    check_seed,
    check_tasks,
    priced_experts,
    run_searcher,
)
from ._space import Recipe, recipe_plan

__all__ = [
    "SEARCHERS",
    "Problem",
    "Recipe",
    "estimate",
    "expert_plans",
    "plan",
    "plan_recipe",
    "run_searcher",
]


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

    `searcher="auto"` (the default) searches the widest space (one stage, pipelines,
    microbatches, ZeRO, rematerialization) with the strongest searcher of each part (the
    ILP, the stage DP) and returns the best feasible plan, never worse than an expert's;
    the DQN and the others stay available by name.

    `budget_s` is seconds of search, counted as work at a nominal rate (the same seed and
    budget give the same plan on any machine); it must be > 0. `float("inf")` means no
    time limit, for the searchers that end on their own (auto, ilp, exhaustive, dp,
    expert: a proof, the whole space); dqn, random and mcmc sample until the budget is
    spent, and refuse it. `origin` records
    what the plan was made for (zoo model and overrides, or an `--fn` path) so that
    `automap apply plan.json` can rebuild the step.

    The DQN only: `agent_in` warm-starts the search from the network of an agent saved by
    `agent_out` (on another model, say); `resume` is a search-state file, continued from
    when it exists and rewritten when the search ends (Ctrl-C included), with `budget_s`
    the total over every run: the same seed then gives the plan of one unbroken search.
    """
    name = check_searcher(searcher)
    budget_s = check_budget(budget_s, (name,))
    seed = check_seed(seed)
    task = check_tasks(tasks, name)
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


def estimate(
    step_fn: Callable, *args: Any, plan: Plan, cluster: Cluster, roles: Any = None
) -> Cost:
    """The cost model's prediction for `plan` applied to `step_fn(*args)` on `cluster`."""
    problem = Problem.build(step_fn, args, cluster, roles)
    _check_fits(problem.graph, plan)
    why = zero_mismatch(problem.graph, problem.groups, plan)
    if why:
        raise PlanError(why)
    plan = sequence_as_recorded(problem.graph, problem.groups, plan)
    if _zero_off_batch(problem, plan):
        warnings.warn(
            f"this ZeRO-{plan.zero_stage} plan does not put the batch on the data axis it "
            "shards over: XLA compiles other collectives for it than the cost model prices "
            "(3-5x the bytes on benchmarks/bench_memory.py's plans), so its prices may be "
            "off. Put the batch on 'data' (as the searchers do) or use zero_stage=0; "
            "am.verify shows what XLA compiles.",
            PriceWarning,
            stacklevel=2,
        )
    return problem.estimate(plan)


def _zero_off_batch(problem: Problem, plan: Plan) -> bool:
    """Whether `plan` is ZeRO over a data axis that does not carry the step's batch: the
    points the searchers leave out (`ShardSpace.zero_options`)."""
    mesh = plan.stages[0].mesh if plan.pipelined else plan.mesh
    batch = problem.groups.batch_groups
    if plan.zero_stage < 1 or mesh.get(DATA, 1) <= 1 or not batch:
        return False
    return problem.cost_model.plan_assignment(plan).get(batch[0]) != DATA


def expert_plans(
    step_fn: Callable, *args: Any, cluster: Cluster, roles: Any = None
) -> dict[str, Plan]:
    """The hand-written plans that apply to this step (data_parallel, zero1-3, megatron,
    megatron_dp, owt for a CNN, gpipe_uniform, megatron_3d), each with its predicted cost;
    infeasible ones are kept, marked by `predicted.feasible`."""
    problem = Problem.build(step_fn, args, cluster, roles)
    return priced_experts(problem)


def plan_recipe(
    step_fn: Callable,
    *args: Any,
    recipe: Recipe,
    cluster: Cluster,
    roles: Any = None,
    origin: Mapping[str, Any] | None = None,
) -> Plan:
    """The plan of a hand-written configuration (`Recipe`: tensor parallel, pipeline
    stages, data parallel, microbatches, schedule, recomputation, ZeRO), priced by the
    cost model. `am.apply` runs it like any other plan; a size that does not divide what
    it splits is a one-line PlanError."""
    problem = Problem.build(step_fn, args, cluster, roles)
    built = problem.priced(recipe_plan(problem.graph, problem.groups, cluster, recipe))
    provenance = Provenance(
        searcher="recipe",
        fingerprint=problem.graph.fingerprint,
        cluster=cluster.name,
        devices=cluster.devices,
        batch=problem.graph.batch_rows,
        notes=built.provenance.notes,  # how the recipe split uneven layers, if it did
        **dict(origin or {}),
    )
    decisions = {**built.decisions, "arg_roles": arg_roles(problem.graph)}
    return dataclasses.replace(
        built, provenance=provenance, in_tree=problem.graph.in_tree, decisions=decisions
    )


def _check_fits(graph: Graph, plan: Plan) -> None:
    fp = plan.provenance.fingerprint
    if fp and fp != graph.fingerprint:
        raise PlanError(other_program(plan, graph))
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
