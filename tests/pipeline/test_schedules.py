"""Every registered pipeline schedule is a valid one, and the parts that read schedules
follow whichever one a plan names: a toy schedule registered here alone (backwards in
forward order) is priced by the cost model in its own order and run by the runtime in it."""

import itertools

import jax
import pytest

import automap as am
from automap import PlanError
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline
from automap._pipeline import (
    Phase,
    PipelineSchedule,
    Task,
    pipeline_plan,
    pipeline_schedule,
    register_schedule,
    schedule_names,
    uniform_cuts,
    unregister_schedule,
)
from automap._space import batch_groups

from ._models import assert_same, flax_args, flax_graph, flax_step

SHAPES = list(itertools.product(range(1, 6), range(1, 9)))  # (stages, microbatches)


class _FifoGPipe(PipelineSchedule):
    """GPipe with its backwards in forward order (first microbatch first): as valid as
    GPipe, and a different order for every stage, so a reader that ignored the schedule
    (or compared names) would show."""

    name = "test-gpipe-fifo"

    def stage_tasks(self, stages, microbatches):
        order = [Task(Phase.FWD, m) for m in range(microbatches)]
        order += [Task(Phase.BWD, m) for m in range(microbatches)]
        return (tuple(order),) * stages

    def in_flight(self, stages, microbatches):
        return (microbatches,) * stages

    def idle_slots(self, stages, microbatches):
        return stages - 1


@pytest.fixture
def fifo():
    schedule = register_schedule(_FifoGPipe())
    yield schedule
    unregister_schedule(schedule.name)


def _live_peak(tasks) -> int:
    """The most microbatches with a forward done and its backward not, in a stage's list."""
    live, peak = set(), 0
    for task in tasks:
        if task.phase is Phase.FWD:
            live.add((task.microbatch, task.chunk))
        elif task.phase is Phase.BWD:
            live.discard((task.microbatch, task.chunk))
        peak = max(peak, len(live))
    return peak


def _schedules():
    return [pipeline_schedule(name) for name in schedule_names()]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_built_in_schedules_are_registered(name):
    assert pipeline_schedule(name).name == name


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_every_schedule_lists_each_unit_once_in_a_valid_order(stages, m):
    for schedule in _schedules():
        orders = schedule.stage_tasks(stages, m)
        assert len(orders) == stages
        want = {
            Task(ph, i, c)
            for ph in (Phase.FWD, Phase.BWD)
            for i in range(m)
            for c in range(schedule.chunks)
        }
        for tasks in orders:
            assert len(tasks) == len(set(tasks)) and set(tasks) == want, schedule.name
            # A stage's own forward of a microbatch comes before its backward.
            pos = {t: k for k, t in enumerate(tasks)}
            assert all(pos[Task(Phase.FWD, i)] < pos[Task(Phase.BWD, i)] for i in range(m))
        # Across stages: run in time (unequal stages, slow sends), every unit starts after
        # what it reads ends, and a stage never runs two units at once.
        times = [(1.0 + s, 2.0 + 0.5 * s) for s in range(stages)]
        sends = [0.25] * stages
        timed = schedule.simulate(stages, m, times, sends)
        assert len(timed) == 2 * stages * m
        end = {(u.stage, u.phase, u.microbatch): u.end for u in timed}
        for u in timed:
            if u.phase is Phase.FWD and u.stage > 0:
                assert u.start >= end[(u.stage - 1, Phase.FWD, u.microbatch)] + 0.25
            if u.phase is Phase.BWD and u.stage < stages - 1:
                assert u.start >= end[(u.stage + 1, Phase.BWD, u.microbatch)] + 0.25
            if u.phase is Phase.BWD:
                assert u.start >= end[(u.stage, Phase.FWD, u.microbatch)]
        for s in range(stages):
            spans = sorted((u.start, u.end) for u in timed if u.stage == s)
            assert all(e <= a for (_, e), (a, _) in itertools.pairwise(spans))
            # ... in the stage's own order.
            own = [
                (u.phase, u.microbatch)
                for u in sorted(timed, key=lambda u: u.start)
                if u.stage == s
            ]
            assert own == [(t.phase, t.microbatch) for t in orders[s]]


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_in_flight_is_the_most_microbatches_live_in_the_task_lists(stages, m):
    for schedule in _schedules():
        peaks = tuple(_live_peak(t) for t in schedule.stage_tasks(stages, m))
        assert schedule.in_flight(stages, m) == peaks, schedule.name


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_idle_slots_are_the_simulated_bubble_on_equal_stages(stages, m):
    f, b = 1.0, 2.0
    for schedule in _schedules():
        timed = schedule.simulate(stages, m, [(f, b)] * stages)
        span = max(u.end for u in timed)
        idle = schedule.idle_slots(stages, m)
        assert span == pytest.approx((m + idle) * (f + b)), schedule.name
        assert schedule.bubble(stages, m) == pytest.approx(1 - m * (f + b) / span)


def test_global_order_keeps_each_stage_order_and_every_dependency():
    for schedule in _schedules():
        order = schedule.global_order(4, 6)
        seen = set()
        for u in order:
            dep = schedule.depends_on(u.stage, Task(u.phase, u.microbatch), 4)
            assert dep is None or dep in seen
            seen.add(u)
        for s, tasks in enumerate(schedule.stage_tasks(4, 6)):
            assert [(u.phase, u.microbatch) for u in order if u.stage == s] == [
                (t.phase, t.microbatch) for t in tasks
            ]


def test_a_bad_name_is_one_line_listing_the_registered_ones(fifo):
    with pytest.raises(
        PlanError,
        match=r"^unknown pipeline schedule 'zb'; use one of gpipe, 1f1b, test-gpipe-fifo\.$",
    ):
        pipeline_schedule("zb")
    graph, groups = flax_graph()
    with pytest.raises(PlanError, match="unknown pipeline schedule 'GPipe'"):
        pipeline_plan(graph, groups, uniform_cuts(graph, groups, 2), {"data": 2}, {}, 2, "GPipe")


def test_registering_refuses_a_taken_name_and_keeps_the_built_in_ones(fifo):
    with pytest.raises(PlanError, match="already registered"):
        register_schedule(_FifoGPipe())
    with pytest.raises(PlanError, match="built in"):
        unregister_schedule("1f1b")
    with pytest.raises(TypeError, match="not a PipelineSchedule"):
        register_schedule("gpipe")


def test_a_schedule_registered_in_a_test_is_priced_and_run_in_its_order(fifo):
    graph, groups = flax_graph()
    mesh = {"data": 2}
    assignment = {g.id: "data" for g in batch_groups(groups)}
    cuts = uniform_cuts(graph, groups, 2)
    plan = pipeline_plan(graph, groups, cuts, mesh, assignment, 2, fifo.name)
    gpipe = pipeline_plan(graph, groups, cuts, mesh, assignment, 2, "gpipe")
    assert plan.schedule == fifo.name  # the plan stores the name
    # The cost model's simulated units follow the toy's order, not GPipe's.
    model = CostModel(graph, Cluster.preset("cpu", devices=4))
    pc = estimate_pipeline(model, plan)
    assert pc.schedule is fifo
    for s in range(2):
        mine = [
            (u.phase, u.microbatch) for u in sorted(pc.ops, key=lambda u: u.start) if u.stage == s
        ]
        assert mine == [(t.phase, t.microbatch) for t in fifo.stage_tasks(2, 2)[s]]
    # The same microbatches in flight as GPipe: the same memory.
    theirs = estimate_pipeline(model, gpipe)
    assert pc.cost.memory_bytes == pytest.approx(theirs.cost.memory_bytes)
    # The runtime dispatches the toy's order and still computes the step.
    args = flax_args()
    run = am.apply(flax_step, plan)
    assert_same(run(*args), jax.jit(flax_step)(*args), 1e-2)
    assert list(run.trace) == fifo.global_order(2, 2)
    assert run.trace != tuple(pipeline_schedule("gpipe").global_order(2, 2))
