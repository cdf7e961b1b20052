"""Budgets: one rule for what a budget may be, and every searcher stops within it."""

import math

import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._errors import AutomapError
from automap._zoo import get_model

CPU8 = am.Cluster.preset("cpu", devices=8)


@pytest.fixture(scope="module")
def mlp():
    spec = get_model("mlp", batch=16, dtype="float32")
    return spec.step_fn, spec.abstract_args()


@pytest.mark.parametrize("budget", [0, -1, math.nan, "10", None, True])
@pytest.mark.parametrize("searcher", ["dqn", "ilp", "random"])
def test_api_refuses_what_the_cli_refuses(mlp, searcher, budget):
    with pytest.raises(AutomapError, match="budget_s is seconds of search and must be a posit"):
        am.plan(mlp[0], *mlp[1], cluster=CPU8, searcher=searcher, budget_s=budget)


@pytest.mark.parametrize("searcher", ["dqn", "random", "mcmc", "auto"])
def test_inf_is_a_clear_error_for_searchers_that_never_end(mlp, searcher):
    with pytest.raises(AutomapError, match="samples until its budget is spent") as err:
        am.plan(mlp[0], *mlp[1], cluster=CPU8, searcher=searcher, budget_s=math.inf)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("searcher", ["ilp", "exhaustive", "expert"])
def test_inf_runs_to_the_end_for_searchers_that_end_on_their_own(mlp, searcher):
    plan = am.plan(mlp[0], *mlp[1], cluster=CPU8, searcher=searcher, budget_s=math.inf)
    assert plan.predicted.feasible
    if searcher == "exhaustive":
        assert plan.decisions["complete"] is True
    if searcher == "ilp":
        assert plan.decisions["optimal"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", "--model", "mlp", "--budget", "inf"), "the auto searcher samples"),
        (("plan", "--model", "mlp", "--searcher", "mcmc", "--budget", "inf"), "the mcmc searcher"),
        (("plan", "--model", "mlp", "--budget", "nan"), "--budget is seconds"),
        (("compare", "--model", "mlp", "--budget", "inf"), "the random searcher"),
        (("bench", "--budget", "inf"), "samples until its budget is spent"),
    ],
)
def test_cli_shares_the_rule(args, message):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_inf_solves_to_the_proof():
    result = CliRunner().invoke(
        app, ["plan", "--model", "mlp", "--searcher", "ilp", "--budget", "inf", "--json"]
    )
    assert result.exit_code == 0, result.output
