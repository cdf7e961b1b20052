"""searcher="ilp": the factored cost is the cost model's, and its optimum is exhaustive's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap as am
from _ilp import ilp_price
from automap._capture import capture
from automap._cost import CostModel
from automap._errors import InfeasibleError
from automap._groups import build_groups
from automap._search import (
    MeshTerms,
    Problem,
    Tracker,
    fine_space,
    options_of,
    run_searcher,
    search_exhaustive,
    search_ilp,
)
from automap._solvers import leanest_problem, solve_exhaustive, solve_ilp
from automap._space import ShardSpace
from automap._zoo import get_model

# Small variants whose spaces the exhaustive searcher enumerates in about a second; odd
# sizes (heads 3, batch 6, vocab 90) let the masks keep the T5 and VGG spaces small.
CASES = {
    "mlp": ("mlp", dict(layers=3, hidden=64, features=32, classes=8, batch=16), "a100", 8),
    "bert": ("bert-base", dict(layers=2, hidden=128, heads=8, seq=32, batch=8), "a100", 16),
    "gpt": (
        "gpt2-xl",
        dict(layers=2, hidden=128, heads=8, seq=32, batch=8, vocab=512),
        "a100",
        8,
    ),
    "t5": (
        "t5-base",
        dict(layers=1, hidden=36, heads=3, ff=72, seq=12, target_seq=6, batch=6, vocab=90),
        "v100",
        8,
    ),
    "vgg": (
        "vgg19",
        dict(depth=11, hidden=3, ff=30, image=32, classes=5, batch=6),
        "v100",
        8,
    ),
}

#: The MLP again on the CPU, whose gradients' all-reduce is not in place: a second memory
#: point, at the end of the backward (`_cost/_model.reduced_gradients`).
CPU_CASES = {"mlp_cpu": (*CASES["mlp"][:2], "cpu", 8)}

_graphs: dict = {}


def _scanned_step(params, batch):
    """Two-matmul layers stacked under `lax.scan`: the backward body's weight-gradient
    all-reduces are combined once per trip (`_cost/_kernel.combined_times`)."""

    def loss_fn(params):
        x, y = batch
        h, _ = jax.lax.scan(
            lambda h, w: (jnp.tanh(h @ w[0]) @ w[1] + h, None), x, (params["w1"], params["w2"])
        )
        return jnp.mean((h - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss


def _scanned_args():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return {"w1": f32(4, 32, 64), "w2": f32(4, 64, 32)}, (f32(16, 32), f32(16, 32))


def problem_for(case: str, **cluster_overrides) -> Problem:
    """The case's problem; each model is captured once per test session."""
    name, overrides, preset, devices = {**CASES, **CPU_CASES}.get(case, ("", {}, "cpu", 8))
    if case not in _graphs:
        if case == "scan":
            graph = capture(_scanned_step, *_scanned_args())
        else:
            spec = get_model(name, **overrides)
            graph = capture(spec.step_fn, *spec.abstract_args())
        _graphs[case] = (graph, build_groups(graph))
    graph, groups = _graphs[case]
    cluster = am.Cluster.preset(preset, devices, **cluster_overrides)
    return Problem(graph, groups, cluster, CostModel(graph, cluster, groups))


_optima: dict = {}


def exhaustive_plan(case: str):
    """The exhaustive searcher's plan on the case's own cluster (computed once)."""
    if case not in _optima:
        _optima[case] = run_searcher(problem_for(case), "exhaustive", budget_s=60, seed=0)
    return _optima[case]


def space_of(problem: Problem) -> ShardSpace:
    return ShardSpace(problem.graph, problem.groups, problem.cluster, problem.cost_model)


@pytest.mark.parametrize("case", ["bert", "t5", "scan", "mlp_cpu"])
def test_factor_sums_are_the_cost_models_figures(case):
    """On random points of every mesh and ZeRO stage (ZeRO-1 too, which the search skips),
    the factors with their auxiliary units at their best give the cost model's step time,
    memory and feasibility (on a scan: its body's gradients combined once per trip; on
    the CPU: the peak of two memory points, the second where the gradients are reduced;
    on GPUs, whose steps are scheduled, one point per candidate moment and the reduction)."""
    space = space_of(problem_for(case))
    if case == "scan":
        assert space.cost_model.tables.combine_trips.tolist() == [1.0, 4.0]
    second_peaks = 0
    rng = np.random.default_rng(0)
    for mesh_index, mesh in enumerate(space.meshes):
        terms = MeshTerms(space, mesh_index)
        for zero in space.zero_options(mesh):
            problem = terms.problem(zero)
            for _ in range(6):
                # A point of the space: with ZeRO, the batch on data (the MILP's masks
                # forbid the rest, `ShardSpace.zero_options`).
                options = options_of(space, mesh_index, rng)
                for _ in range(1000):
                    if zero in space.zero_options(mesh, options):
                        break
                    options = options_of(space, mesh_index, rng)
                cost = space.evaluate(mesh_index, options, zero_stage=zero)
                time, memory, feasible = ilp_price(problem, terms.n_units, options)
                assert time == pytest.approx(cost.step_time_s, rel=1e-9)
                assert memory == pytest.approx(cost.memory_bytes, rel=1e-9)
                assert feasible == cost.feasible
                # GPUs: a point per candidate moment of the scheduled step (its last op
                # among them: the step donates nothing), and the gradients' reduction;
                # the CPU: the backward's peak, the reduction's and the update's
                moments = space.cost_model.tables.moments
                assert len(problem.memory_factors) == (
                    len(moments.at) + 1 if moments is not None else 3
                )
                if moments is not None:
                    assert moments.at[-1] == len(space.graph.ops) - 1
                assert (moments is None) == (space.cluster.name == "cpu")
                second_peaks += cost.memory_breakdown["activations"] == 0.0
    if case == "mlp_cpu":  # its gradients outweigh its activations: often the second point
        assert second_peaks > 0


def test_the_leanest_point_of_two_memory_points_is_their_least_peak():
    # On the CPU a mesh's leanest point minimizes the larger of the backward's peak and
    # the gradients' reduction (not a sum: `leanest_problem` with minimize="peak"); the
    # MILP finds what enumerating the mesh finds.
    space = space_of(problem_for("mlp_cpu"))
    for mesh_index, mesh in enumerate(space.meshes):
        terms = MeshTerms(space, mesh_index)
        for zero in space.zero_options(mesh):
            lean = leanest_problem(terms.problem(zero, np.inf))
            assert lean.minimize == "peak"
            ilp, every = solve_ilp(lean), solve_exhaustive(lean)
            assert ilp.optimal and ilp.time == pytest.approx(every.time, rel=1e-9)
            assert ilp.time == pytest.approx(ilp.memory, rel=1e-9)


@pytest.mark.parametrize("case", [*CASES, "scan"])
def test_ilp_finds_the_exhaustive_optimum(case):
    exhaustive = exhaustive_plan(case)
    ilp = run_searcher(problem_for(case), "ilp", budget_s=60, seed=0)
    assert ilp.predicted.feasible
    assert ilp.predicted.step_time_s == pytest.approx(exhaustive.predicted.step_time_s, rel=1e-9)
    stats = ilp.decisions
    assert stats["optimal"] and stats["gap"] <= 1e-9
    # Each MILP's objective at its point is the cost model's figure: the factoring is exact.
    assert stats["objective_error"] <= 1e-6
    assert stats["evaluated"] == len(stats["curve"]) > 0


def test_memory_limit_moves_the_optimum_and_the_ilp_follows():
    free = exhaustive_plan("bert").predicted
    seen = set()
    # Limits below the unconstrained optimum's memory: first another layout, then ZeRO.
    # (0.3, not 0.2: ZeRO no longer shards the local gradients, which XLA holds whole
    # until their reduce-scatter, so the smallest plan is larger than it was priced. And
    # 0.97: since ZeRO-1/2 keeps this bf16 BERT's float32 masters on shards, ZeRO-1 fits
    # every limit from 0.9 down.)
    for fraction in (0.97, 0.9, 0.5, 0.3):
        hbm = free.memory_bytes * fraction / 0.9  # 10% of HBM is the default reserve
        problem = problem_for("bert", hbm_bytes=hbm)
        exhaustive = run_searcher(problem, "exhaustive", budget_s=60, seed=0)
        ilp = run_searcher(problem, "ilp", budget_s=60, seed=0)
        assert ilp.predicted.feasible and ilp.predicted.memory_bytes <= problem.cluster.memory_limit
        assert ilp.predicted.step_time_s == pytest.approx(
            exhaustive.predicted.step_time_s, rel=1e-9
        )
        assert ilp.predicted.step_time_s > free.step_time_s * (1 + 1e-6)
        seen.add((tuple(ilp.mesh.items()), ilp.zero_stage))
    assert len(seen) >= 2


# vgg at 0.4, not 0.3: ZeRO no longer shards the local gradients (XLA holds them whole
# until their reduce-scatter), and no plan of its space fits in 0.3 any more.
@pytest.mark.parametrize(("case", "fraction"), [("t5", 0.5), ("vgg", 0.4)])
def test_ilp_matches_exhaustive_under_tight_memory(case, fraction):
    free = exhaustive_plan(case).predicted
    problem = problem_for(case, hbm_bytes=free.memory_bytes * fraction / 0.9)
    exhaustive = run_searcher(problem, "exhaustive", budget_s=60, seed=0).predicted
    ilp = run_searcher(problem, "ilp", budget_s=60, seed=0)
    assert ilp.zero_stage > 0  # these limits need ZeRO
    assert ilp.predicted.step_time_s == pytest.approx(exhaustive.step_time_s, rel=1e-9)


def test_no_plan_fits_means_infeasible_for_both():
    problem = problem_for("mlp", hbm_bytes=1e3)
    with pytest.raises(InfeasibleError):
        run_searcher(problem, "exhaustive", budget_s=60, seed=0)
    with pytest.raises(InfeasibleError, match="ilp"):
        run_searcher(problem, "ilp", budget_s=60, seed=0)


def test_per_group_space_is_solved_exactly_too():
    space = fine_space(space_of(problem_for("bert")))
    assert len(space.units) > len(space_of(problem_for("bert")).units)
    point, stats = search_ilp(space)
    tracker = search_exhaustive(space, Tracker(budget_s=60))
    found = space.evaluate(point[0], point[1], zero_stage=point[2]).step_time_s
    assert found == pytest.approx(tracker.best_time, rel=1e-9)
    assert stats["optimal"] and stats["objective_error"] <= 1e-6


def test_ilp_is_a_public_searcher():
    name, overrides, _, _ = CASES["mlp"]
    spec = get_model(name, **overrides)
    plan = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=am.Cluster.preset("a100", 8), searcher="ilp"
    )
    assert plan.provenance.searcher == "ilp" and plan.predicted.feasible
