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
    plan_schedule,
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


def _schedules(stages: int = 1, m: int = 1):
    """Every registered schedule, interleaved 1F1B with 2 and 3 chunks, each where it
    runs `m` microbatches on `stages` device groups (interleaved: whole rounds of S)."""
    out = [pipeline_schedule(name) for name in schedule_names()]
    out += [pipeline_schedule("interleaved", 3)]
    return [s for s in out if s.chunks == 1 or stages == 1 or m % stages == 0]


def _device(schedule, p, stages):
    """The device group of virtual stage p, and its chunk there."""
    return p % stages, p // stages


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_the_built_in_schedules_are_registered(name):
    assert pipeline_schedule(name).name == name


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_every_schedule_lists_each_unit_once_in_a_valid_order(stages, m):
    for schedule in _schedules(stages, m):
        v, phases = schedule.chunks, schedule.phases
        orders = schedule.stage_tasks(stages, m)
        assert len(orders) == stages
        want = {Task(ph, i, c) for ph in phases for i in range(m) for c in range(v)}
        for tasks in orders:
            assert len(tasks) == len(set(tasks)) and set(tasks) == want, schedule.name
            # A stage's own forward of a microbatch comes before its backward (before its
            # weight gradients, where split).
            pos = {t: k for k, t in enumerate(tasks)}
            for i, c in itertools.product(range(m), range(v)):
                assert pos[Task(Phase.FWD, i, c)] < pos[Task(Phase.BWD, i, c)]
                if Phase.WGT in phases:
                    assert pos[Task(Phase.BWD, i, c)] < pos[Task(Phase.WGT, i, c)]
        # Across virtual stages: run in time (unequal stages, slow sends), every unit starts
        # after what it reads ends, and a device never runs two units at once.
        P = stages * v
        times = [(1.0 + p, 1.25 + 0.25 * p, 0.75 + 0.25 * p) for p in range(P)]
        timed = schedule.simulate(stages, m, times, [0.25] * P)
        assert len(timed) == len(phases) * P * m
        end = {(u.stage, u.phase, u.microbatch): u.end for u in timed}
        for u in timed:
            if u.phase is Phase.FWD and u.stage > 0:
                assert u.start >= end[(u.stage - 1, Phase.FWD, u.microbatch)] + 0.25
            if u.phase is Phase.BWD and u.stage < P - 1:
                assert u.start >= end[(u.stage + 1, Phase.BWD, u.microbatch)] + 0.25
            if u.phase is Phase.BWD:
                assert u.start >= end[(u.stage, Phase.FWD, u.microbatch)]
            if u.phase is Phase.WGT:  # its own stage's backward, no send between
                assert u.start >= end[(u.stage, Phase.BWD, u.microbatch)]
            f, b, w = times[u.stage]  # a backward not split runs both of its parts
            want_s = {Phase.FWD: f, Phase.BWD: b if Phase.WGT in phases else b + w, Phase.WGT: w}
            assert u.end - u.start == pytest.approx(want_s[u.phase])
        for s in range(stages):
            mine = sorted((u for u in timed if _device(schedule, u.stage, stages)[0] == s),
                          key=lambda u: u.start)  # fmt: skip
            assert all(a.end <= b.start for a, b in itertools.pairwise(mine))
            # ... in the device's own order.
            own = [Task(u.phase, u.microbatch, _device(schedule, u.stage, stages)[1]) for u in mine]
            assert own == list(orders[s])


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_in_flight_is_the_most_microbatches_live_in_the_task_lists(stages, m):
    for schedule in _schedules(stages, m):
        lists = schedule.stage_tasks(stages, m)
        peaks = tuple(_live_peak(t) for t in lists)
        assert schedule.in_flight(stages, m) == peaks, schedule.name
        # Per virtual stage at its device's peak: the device's peak shared by its chunks.
        per = schedule.stage_in_flight(stages, m)
        assert len(per) == stages * schedule.chunks
        assert all(sum(per[s::stages]) == peaks[s] for s in range(stages))
        if schedule.chunks == 1:
            assert per == peaks


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_idle_slots_are_the_simulated_bubble_on_equal_stages(stages, m):
    # A backward twice a forward, its input and weight gradients equal (ZB-H1's count).
    f, b, w = 1.0, 1.0, 1.0
    for schedule in _schedules(stages, m):
        v = schedule.chunks  # each virtual stage does 1/v of its device's work
        timed = schedule.simulate(stages, m, [(f / v, b / v, w / v)] * (stages * v))
        span = max(u.end for u in timed)
        idle = schedule.idle_slots(stages, m)
        assert span == pytest.approx((m + idle) * (f + b + w)), schedule.name
        assert schedule.bubble(stages, m) == pytest.approx(1 - m * (f + b + w) / span)


def test_global_order_keeps_each_stage_order_and_every_dependency():
    for schedule in _schedules(4, 8):
        order = schedule.global_order(4, 8)
        seen = set()
        for u in order:
            s, c = _device(schedule, u.stage, 4)
            dep = schedule.depends_on(s, Task(u.phase, u.microbatch, c), 4)
            assert dep is None or dep in seen
            seen.add(u)
        for s, tasks in enumerate(schedule.stage_tasks(4, 8)):
            assert [
                Task(u.phase, u.microbatch, _device(schedule, u.stage, 4)[1])
                for u in order
                if _device(schedule, u.stage, 4)[0] == s
            ] == list(tasks)


def test_interleaving_shrinks_the_bubble_v_fold_for_more_in_flight():
    """Narayanan et al. (2021), section 2.2.2: the bubble of 1F1B over v, paid for in
    activations held (per device, in units of its whole model's: chunks / v)."""
    one = pipeline_schedule("1f1b")
    for v in (2, 3, 4):
        il = pipeline_schedule("interleaved", v)
        for stages, m in ((2, 4), (4, 8), (4, 16), (8, 8)):
            assert il.idle_slots(stages, m) == pytest.approx(one.idle_slots(stages, m) / v)
            assert il.bubble(stages, m) < one.bubble(stages, m)
            held = [n / v for n in il.in_flight(stages, m)]
            assert held[0] >= one.in_flight(stages, m)[0]
    # Megatron-LM's first group warms up with 2 (S - 1) + (v - 1) S forwards.
    assert pipeline_schedule("interleaved", 2).in_flight(4, 8) == (11, 9, 7, 5)


def test_interleaving_refuses_what_it_cannot_run_in_one_line():
    with pytest.raises(PlanError, match=r"^interleaved 1F1B needs 2 or more virtual stages"):
        pipeline_schedule("interleaved", 1)
    with pytest.raises(PlanError, match=r"do not divide into rounds of 4; use a multiple of 4"):
        pipeline_schedule("interleaved", 2).stage_tasks(4, 6)
    with pytest.raises(PlanError, match=r"^pipeline schedule '1f1b' runs one model chunk"):
        pipeline_schedule("1f1b", 2)
    graph, groups = flax_graph()
    cuts = uniform_cuts(graph, groups, 3)
    with pytest.raises(PlanError, match=r"3 pipeline stages do not split into 2 virtual"):
        pipeline_plan(graph, groups, cuts, {}, {}, 2, "interleaved", virtual_stages=2)


def test_an_interleaved_plan_lists_its_chunks_on_repeating_device_groups():
    graph, groups = flax_graph()
    cuts = uniform_cuts(graph, groups, 4)
    plan = pipeline_plan(graph, groups, cuts, {"data": 2}, {}, 2, "interleaved", virtual_stages=2)
    assert plan.mesh["pipe"] == 2 and len(plan.stages) == 4 and plan.virtual_stages == 2
    assert [s.devices for s in plan.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert am.Plan.from_dict(plan.to_dict()).virtual_stages == 2  # survives a plan file
    assert plan_schedule(plan).chunks == 2
    d = plan.to_dict()
    d["stages"][2]["devices"] = [2, 3]
    with pytest.raises(PlanError, match=r"stage 2 runs on devices \[2, 3\], but with 2 device"):
        am.Plan.from_dict(d)


def test_a_bad_name_is_one_line_listing_the_registered_ones(fifo):
    with pytest.raises(
        PlanError,
        match=r"^unknown pipeline schedule 'zb'; use one of gpipe, 1f1b, interleaved, zb-h1, "
        r"test-gpipe-fifo\.$",
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
