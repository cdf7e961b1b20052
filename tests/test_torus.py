"""Mesh axes on a TPU torus (`_cost/_torus.py`): each axis priced by the torus dimensions
JAX lays it on, wraparound where a dimension is complete, DCN across slices."""

import json

import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._cost import (
    AR,
    AxisCosts,
    axis_links,
    axis_torus_dims,
    ring_allreduce_time,
    tree_allreduce_time,
)

GB = 1e9


def _bandwidths(cluster, mesh):
    return {k: (link.bandwidth / GB, link.kind) for k, link in axis_links(cluster, mesh).items()}


def test_an_axis_runs_on_every_torus_dimension_it_spans():
    # v5p 4x4x4: each dimension wraps (a whole cube), 100 GB/s per link and direction, so a
    # ring per direction in every dimension an axis spans: the 4-chip model axis lies on
    # one dimension (200 GB/s), the 16-chip data axis on the other two (400 GB/s).
    v5p = am.Cluster.preset("tpu-v5p", topology="4x4x4")
    assert _bandwidths(v5p, {"data": 16, "model": 4}) == {
        "data": (400.0, "intra"),
        "model": (200.0, "intra"),
    }
    assert _bandwidths(v5p, {"data": 64}) == {"data": (600.0, "intra")}
    # An axis on part of a dimension has no wraparound: one link's bandwidth.
    assert _bandwidths(v5p, {"data": 2, "fsdp": 8, "model": 4}) == {
        "data": (100.0, "intra"),
        "fsdp": (300.0, "intra"),
        "model": (200.0, "intra"),
    }


def test_a_slice_without_wraparound_prices_lines():
    # v5e wraps only across the whole 16x16 pod: a 4x4 slice is a mesh of lines.
    v5e = am.Cluster.preset("tpu-v5e", topology="4x4")
    assert _bandwidths(v5e, {"data": 4, "model": 4}) == {
        "data": (50.0, "intra"),
        "model": (50.0, "intra"),
    }
    pod = am.Cluster.preset("tpu-v6e", topology="16x16")
    assert _bandwidths(pod, {"data": 16, "model": 16})["model"] == (200.0, "intra")


def test_axes_across_slices_run_on_the_data_centre_network():
    # Two v5p-128 slices: the leading axis takes the slices (a hybrid mesh's DCN axis),
    # at 50 Gbps per chip; split across and within slices, it is as slow as the DCN.
    two = am.Cluster.preset("tpu-v5p", topology="4x4x4", slices=2)
    links = _bandwidths(two, {"data": 2, "fsdp": 16, "model": 4})
    assert links == {"data": (6.25, "inter"), "fsdp": (400.0, "intra"), "model": (200.0, "intra")}
    assert _bandwidths(two, {"data": 32, "model": 4})["data"] == (6.25, "mixed")


def test_an_all_reduce_on_the_torus_costs_what_its_rings_carry():
    # A 1 GB all-reduce over 64 chips of a 4x4x4 slice runs at 600 GB/s (six links out of
    # each chip) times the comm efficiency, a ring or a tree, the cheaper.
    v5p = am.Cluster.preset("tpu-v5p", topology="4x4x4")
    costs = AxisCosts(v5p, {"data": 64})
    bw, alpha = 600 * GB * v5p.comm_efficiency, v5p.intra_latency
    expected = min(ring_allreduce_time(1e9, 64, bw, alpha), tree_allreduce_time(1e9, 64, bw, alpha))
    assert costs.time1(AR, costs.codes["data"], 1e9) == pytest.approx(expected, rel=1e-9)
    flat = AxisCosts(am.Cluster.preset("tpu-v5p", devices=48), {"data": 48})  # no slice
    assert flat.time1(AR, flat.codes["data"], 1e9) > 2 * expected


def test_the_cli_prices_a_slice_and_slices_over_dcn():
    # 128 v5p chips data-parallel: as one 4x4x8 slice the gradients' all-reduce runs on the
    # torus; as two 4x4x4 slices (--slices 2) the data axis crosses the DCN, far slower.
    def comm(*flags):
        cmd = ["estimate", "--model", "mlp", "--set", "batch=256", "--cluster", "tpu-v5p"]
        out = CliRunner().invoke(app, [*cmd, *flags, "--dp", "128", "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)["comm_s"]

    assert comm("--slices", "2", "--devices", "128") > 3 * comm("--topology", "4x4x8")
    out = CliRunner().invoke(app, ["estimate", "--model", "mlp", "--topology", "4x4x4"])
    assert out.exit_code != 0 and "cluster preset a100 is no TPU" in out.output


def test_an_axis_counts_the_torus_dimensions_its_groups_span():
    # As JAX lays the mesh on a v5p 2x2x2 cube: 8 on data spans all three dimensions, the
    # 4 of (4, 2) two and its 2 one; across slices an axis spans none of one slice's.
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    assert axis_torus_dims(v5p, {"data": 8}) == {"data": 3}
    assert axis_torus_dims(v5p, {"data": 4, "model": 2}) == {"data": 2, "model": 1}
    assert axis_torus_dims(v5p, {"data": 2, "model": 4}) == {"data": 1, "model": 2}
    two = am.Cluster.preset("tpu-v5p", topology="2x2x2", slices=2)
    assert axis_torus_dims(two, {"data": 2, "model": 8}) == {"data": 0, "model": 3}
    assert axis_torus_dims(am.Cluster.preset("a100", devices=8), {"data": 8}) == {"data": 0}
