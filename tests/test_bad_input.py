"""Bad input, in one table: each row is a one-line error that names the problem and the
fix, or (where the input is fine after all) the right result. Issue 14, section 5."""

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._zoo import get_model

CPU8 = am.Cluster.preset("cpu", devices=8)
runner = CliRunner()
MLP_PLAN = ("plan", "--model", "mlp", "--set", "dtype=float32", "--cluster", "cpu")


def _mlp():
    spec = get_model("mlp", batch=16, dtype="float32")
    return spec.step_fn, spec.concrete_args(0)


def _api_error(call: Callable[[], object]) -> str:
    """The message of the AutomapError `call` raises (the test fails when it raises none)."""
    with pytest.raises(am.AutomapError) as info:
        call()
    return str(info.value)


def _cli_error(*args: str) -> str:
    """The one error line a command prints on stderr, exit code 2, nothing on stdout."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    return result.stderr


def _cli_ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _cluster_file(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"preset: a100\n{line}\n")
    return path


def _cluster_error(line: str) -> Callable[[Path], str]:
    return lambda tmp: _api_error(lambda: am.Cluster.from_file(_cluster_file(tmp, line)))


def _numeric_string_is_a_number(tmp: Path) -> str:
    cluster = am.Cluster.from_file(_cluster_file(tmp, "peak_flops: 312e12"))
    assert cluster.peak_flops == 312e12  # PyYAML reads 312e12 as a string
    return f"peak {cluster.peak_flops:g}"


def _plan_with(**kwargs) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        step_fn, args = _mlp()
        options = {"cluster": CPU8, "searcher": "expert"} | kwargs
        return _api_error(lambda: am.plan(step_fn, *args, **options))

    return run


def _apply_with(plan: object) -> Callable[[Path], str]:
    return lambda tmp: _api_error(lambda: am.apply(_mlp()[0], plan))


def _no_argument_step(tmp: Path) -> str:
    w = jnp.ones((8, 8))
    return _api_error(lambda: am.plan(lambda: jnp.sum(w @ w), cluster=CPU8, searcher="ilp"))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Path], str]  # the message (error) or output (right result) to check
    match: str  # a regular expression the text must contain
    error: bool = True  # an error must be one line


CASES = [
    # 1. Cluster files: the field, the type and the allowed range.
    Case("hbm_80GB", _cluster_error('hbm_bytes: "80GB"'), r"hbm_bytes must be a number \(bytes\) > 0, got '80GB'"),
    Case("peak_numeric_string", _numeric_string_is_a_number, r"peak 3\.12e\+14", error=False),
    Case("per_node_0", _cluster_error("devices_per_node: 0"), r"devices_per_node must be an integer >= 1, got 0"),
    Case("intra_bw_0", _cluster_error("intra_bandwidth: 0"), r"intra_bandwidth must be a number \(bytes/s\) > 0"),
    Case("peak_negative", _cluster_error("peak_flops: -1.0e+12"), r"peak_flops must be a number \(FLOP/s\) > 0, got -1e\+12"),
    Case("efficiency_1.5", _cluster_error("comm_efficiency: 1.5"), r"comm_efficiency must be a number > 0 and <= 1"),
    Case("per_node_half", _cluster_error("devices_per_node: 2.5"), r"devices_per_node must be an integer"),
    Case("reduce_scatter_word", _cluster_error("reduce_scatter: maybe"), r"reduce_scatter must be true or false"),
    Case("cli_cluster_file", lambda tmp: _cli_error(*MLP_PLAN[:-2], "--cluster", str(_cluster_file(tmp, "peak_flops: -1"))), r"peak_flops must be"),
    # 4. The Python API.
    Case("cluster_string", _plan_with(cluster="a100"), r"not the string 'a100': use am\.Cluster\.preset\('a100'"),
    Case("cluster_none", _plan_with(cluster=None), r"cluster must be a Cluster, got NoneType"),
    Case("apply_path", _apply_with("plan.json"), r"not the path 'plan\.json': load it first"),
    Case("apply_none", _apply_with(None), r"apply takes a Plan .* got NoneType"),
    Case("load_directory", lambda tmp: _api_error(lambda: am.Plan.load(tmp)), r"is a directory, not a plan file"),
    Case("role_unknown", _plan_with(roles={"params": "weights"}), r"'weights' is not a role; use one of 'param', 'opt_state', 'batch', 'other'"),
    Case("role_key_unknown", _plan_with(roles={"nonexistent": "param"}), r"roles key 'nonexistent' matches no argument .*argument names: 'params'"),
    Case("role_index_unknown", _plan_with(roles={7: "param"}), r"roles key 7 matches no argument"),
    Case("no_argument_step", _no_argument_step, r"takes no array arguments"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = case.run(tmp_path)
    assert re.search(case.match, text), text
    if case.error:
        assert len(text.strip().splitlines()) == 1, text
