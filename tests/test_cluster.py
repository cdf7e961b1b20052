import json

import pytest

import automap as am


def test_presets_listed_and_built():
    assert {"v100", "a100", "h100", "h200", "tpu-v4", "cpu"} <= set(am.Cluster.presets())
    c = am.Cluster.preset("a100", devices=16)
    assert c.devices == 16 and c.nodes == 2 and c.devices_per_node == 8
    assert c.peak_flops == 312e12 and c.hbm_bytes == 80e9
    assert c.memory_limit < c.hbm_bytes


def test_axis_links_follow_the_node_hierarchy():
    c = am.Cluster.preset("h100", devices=64)
    links = c.axis_links({"data": 8, "model": 8})
    assert links["model"].kind == "intra" and links["data"].kind == "inter"
    assert links["model"].bandwidth > links["data"].bandwidth
    mixed = c.axis_links({"data": 4, "model": 16})
    assert mixed["model"].kind == "mixed"
    assert mixed["model"].bandwidth == c.inter_bandwidth


def test_mesh_larger_than_cluster_is_refused():
    with pytest.raises(am.ClusterError, match="needs 32 devices"):
        am.Cluster.preset("a100", devices=16).axis_links({"data": 4, "model": 8})


def test_unknown_preset_and_partial_nodes():
    with pytest.raises(am.ClusterError, match="unknown cluster preset 'b200'"):
        am.Cluster.preset("b200")
    with pytest.raises(am.ClusterError, match="whole nodes"):
        am.Cluster.preset("a100", devices=12)


def test_cluster_from_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("preset: v100\ndevices: 16\nmatmul_efficiency: 0.5\n")
    c = am.Cluster.from_file(yaml_file)
    assert c.name == "v100" and c.devices == 16 and c.matmul_efficiency == 0.5
    full = am.Cluster.preset("h200", devices=8).to_dict()
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps(full))
    assert am.Cluster.from_file(json_file) == am.Cluster.preset("h200", devices=8)


def test_bad_cluster_files(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"name": "x", "devices": 8, "warp_speed": 9}))
    with pytest.raises(am.ClusterError, match="warp_speed"):
        am.Cluster.from_file(bad)
    bad.write_text("{")
    with pytest.raises(am.ClusterError, match="could not be parsed"):
        am.Cluster.from_file(bad)
    with pytest.raises(am.ClusterError, match="no cluster file"):
        am.Cluster.from_file(tmp_path / "none.yaml")
