"""The DQN's pipeline and hybrid tasks: environments, masks, pricing, end-to-end plans."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import automap as am
from automap._cost import estimate_pipeline
from automap._pipeline import partition
from automap._search import (
    HybridProcess,
    PipelinePricer,
    PipelineProcess,
    Problem,
    ShardProcess,
    baseline_time,
    best_expert,
    make_pipeline_process,
    planning_env,
)
from automap._space import ShardSpace
from automap._zoo import get_model
from automap.rl import DQNConfig, search

SMALL = dict(layers=4, hidden=64, heads=4, batch=16, seq=16)


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt2-xl", **SMALL)
    problem = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 8))
    space = ShardSpace(problem.graph, problem.groups, problem.cluster, problem.cost_model)
    return spec, problem, space, baseline_time(space)


def _random_episode(process, rng) -> tuple[int, ...]:
    process.reset()
    while not process.done():
        mask = process.action_mask()
        assert mask.any()
        process.step(int(rng.choice(np.flatnonzero(mask))))
    return process.decisions()


@pytest.mark.parametrize("task", ["pipeline", "hybrid"])
def test_check_env_passes(gpt, task):
    problem = gpt[1]
    env = planning_env(problem.graph, problem.cluster, task)
    assert isinstance(env.process, PipelineProcess if task == "pipeline" else HybridProcess)
    check_env(env.unwrapped)


@pytest.mark.parametrize("task", ["pipeline", "hybrid"])
def test_a_decision_of_more_choices_than_the_observations_slots_is_observed(task):
    """512 sequences a step offer ten microbatch counts on two stages, more than the eight
    per-action slots of the observation: each is still an action, and every observation
    is made (SC'21's 1.7B row raised a broadcast error in the hybrid task's first one)."""
    spec = get_model("gpt2-xl", **{**SMALL, "batch": 512})
    problem = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 2))
    env = planning_env(problem.graph, problem.cluster, task)
    process, rng, widest = env.process, np.random.default_rng(0), 0
    for _ in range(3):
        process.reset()
        while not process.done():
            obs, mask = np.asarray(process.observation()), process.action_mask()
            assert obs.shape == (env.observation_space.shape[0],) and np.isfinite(obs).all()
            if process.phase_name() == "microbatches":
                widest = max(widest, int(mask.sum()))
            process.step(int(rng.choice(np.flatnonzero(mask))))
    assert widest > 8


def test_coarse_partition_is_partition(gpt):
    _, problem, _, _ = gpt
    pricer = PipelinePricer(problem.cost_model)
    graph, groups = problem.graph, problem.groups
    for cuts in [(0,), (3, 7), (1, 4, 8)]:
        starts = [pricer.cands[i] for i in cuts]
        bounds = list(zip((0, *starts), (*starts, len(graph.ops)), strict=True))
        assert pricer.coarse(cuts) == partition(graph, groups, bounds, 4)


def test_masks_keep_stages_non_empty_and_priced_as_estimate_pipeline(gpt):
    _, problem, space, base = gpt
    process = make_pipeline_process(space, "pipeline", base)
    devices, n_cands = problem.cluster.devices, len(process.pricer.cands)
    assert process.stage_choices and all(devices % s == 0 for s in process.stage_choices)
    rng = np.random.default_rng(0)
    for _ in range(12):
        decisions = _random_episode(process, rng)
        _, _, cuts, chunks, _ = process._point()  # interleaved (chunks > 1): no cut decided
        assert len(cuts) == process._stages * chunks - 1
        assert len(process._cuts) == (process._stages - 1 if chunks == 1 else 0)
        # Stage s covers segments cuts[s-1]+1 .. cuts[s]; the last one ends at n_cands.
        pairs = zip([-1, *cuts], [*cuts, n_cands], strict=True)
        assert all(a < b for a, b in pairs)
        time_s, feasible, _ = process.result()
        plan = process.to_plan(decisions)
        assert plan.mesh["pipe"] * chunks == len(plan.stages) == len(cuts) + 1
        assert plan.virtual_stages == chunks
        assert plan.predicted.step_time_s == pytest.approx(time_s, rel=1e-12)
        assert estimate_pipeline(problem.cost_model, plan).cost.feasible == feasible


def test_hybrid_one_stage_is_the_shard_task(gpt):
    _, problem, space, base = gpt
    hybrid = make_pipeline_process(space, "hybrid", base)
    assert all(problem.cluster.devices % s == 0 for s in hybrid.stage_choices)
    assert hybrid.stage_choices[0] == 1
    shard = ShardProcess(space, base)
    rng = np.random.default_rng(1)
    for _ in range(5):
        decisions = _random_episode(shard, rng)
        hybrid.reset()
        for a in (0, *decisions):
            hybrid.step(a)
        # Then one stage's techniques: none and off price the shard task's plan.
        while not hybrid.done():
            assert hybrid.phase_name() in ("remat", "sequence_parallel")
            hybrid.step(0)
        assert hybrid.result() == shard.result()
    for _ in range(8):  # pipelined episodes: each stage's mesh fills devices // S
        decisions = _random_episode(hybrid, rng)
        S = hybrid._stages
        assert hybrid.sub(S).space.cluster.devices == problem.cluster.devices // S
        time_s, _, _ = hybrid.result()
        if S > 1:
            plan = hybrid.to_plan(decisions)  # polished: never slower than the reward's
            # An interleaved plan lists S x v stages (virtual stages).
            assert len(plan.stages) == S * plan.virtual_stages
            assert plan.predicted.step_time_s <= time_s * (1 + 1e-9)
            cost = estimate_pipeline(problem.cost_model, plan).cost
            assert cost.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


@pytest.mark.slow  # two DQN searches over pipelines
def test_dqn_pipeline_end_to_end_and_reproducible(gpt):
    spec, problem, _, _ = gpt
    args = dict(cluster=problem.cluster, searcher="dqn", tasks=("pipeline",), budget_s=1.0)
    plan = am.plan(spec.step_fn, *spec.abstract_args(), seed=3, **args)
    assert plan.predicted.feasible and len(plan.stages) > 1
    cost = estimate_pipeline(problem.cost_model, plan).cost
    assert plan.predicted.step_time_s == pytest.approx(cost.step_time_s, rel=1e-9)
    expert = best_expert(problem, "pipeline")
    assert plan.predicted.step_time_s <= expert.predicted.step_time_s * (1 + 1e-9)
    again = am.plan(spec.step_fn, *spec.abstract_args(), seed=3, **args)
    assert again.decisions["cuts"] == plan.decisions["cuts"] and again.mesh == plan.mesh


def test_dqn_hybrid_no_worse_than_experts(gpt):
    spec, problem, _, _ = gpt
    plan = am.plan(
        spec.step_fn,
        *spec.abstract_args(),
        cluster=problem.cluster,
        searcher="dqn",
        tasks=("shard", "pipeline"),
        budget_s=1.0,
    )
    expert = best_expert(problem, "hybrid")
    assert plan.predicted.feasible
    assert plan.predicted.step_time_s <= expert.predicted.step_time_s * (1 + 1e-9)


def test_dqn_finds_the_two_stage_optimum_at_least_as_often_as_random(gpt):
    """Two stages: the optimum over every microbatch count and every cut is enumerated;
    over 8 seeds and 8 episodes each the DQN reaches it at least as often as uniform
    random valid actions. (At this budget the agent has not trained yet: the two tie,
    4 of 8 each; see the note.) The 2021 space: the microbatches and the cuts alone."""
    _, problem, _, base = gpt
    pricer = PipelinePricer(problem.cost_model)
    process = PipelineProcess(pricer, base, stage_choices=(2,), techniques=False)
    intra = process.intra(2)
    optimum = min(
        pricer.price(intra, m, (i,)).cost.step_time_s
        for m in process.micro_choices(intra, 2)
        for i in range(len(pricer.cands))
    )
    goal = optimum * (1 + 1e-9)
    episodes, dqn_hits, random_hits = 8, 0, 0
    for seed in range(8):
        config = DQNConfig(max_episodes=episodes)
        found = search(process, budget_s=60.0, seed=seed, config=config, stop_at=goal)
        dqn_hits += found.best_time <= goal
        rng = np.random.default_rng(seed)
        random_hits += any(
            (_random_episode(process, rng), process.result()[0])[1] <= goal for _ in range(episodes)
        )
    assert dqn_hits >= random_hits and dqn_hits >= 3
