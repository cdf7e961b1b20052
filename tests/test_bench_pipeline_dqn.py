"""benchmarks/bench_pipeline_dqn.py: the DQN's hybrid task against the dp searcher, on the
zoo's rows and on two published ones, whose models must be the ones `automap bench`
prices (issue 26 item 6: on the benchmark rows where both run, the DQN reaches dp's plan)."""

from __future__ import annotations

import pytest

from _scripts import load_script
from automap._bench import KORTHIKANTI_TABLE, MEGATRON_TABLE, job_of


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_pipeline_dqn")


def test_the_published_rows_are_the_ones_automap_bench_prices(bench):
    sc21 = next(r for r in MEGATRON_TABLE if r.params_b == 1.7)
    korthikanti = next(r for r in KORTHIKANTI_TABLE if r.name == "22B")
    assert bench.PUBLISHED["sc21-1.7B"]() == job_of(sc21)
    assert bench.PUBLISHED["korthikanti-22B"]() == korthikanti.job()
    assert korthikanti.job().devices == 8 and job_of(sc21).devices == 32


def test_an_unknown_row_is_named_with_the_known_ones(bench):
    with pytest.raises(SystemExit, match=r"unknown row 'nope': use one of .*korthikanti-22B"):
        bench.problem_of("nope")
