import dataclasses
import json
import re

import pytest
from jax.sharding import PartitionSpec

import automap as am
from automap._plan import Provenance, Stage


def _plan() -> am.Plan:
    cost = am.Cost(
        step_time_s=0.5,
        compute_s=0.4,
        comm_s=0.1,
        bubble_s=0.0,
        memory_bytes=1e9,
        mfu=0.4,
        memory_limit_bytes=7.2e10,
        memory_breakdown={"params": 5e8, "activations": 5e8},
        collectives=(am.Collective("all-reduce", "data", 4e8, 1, 0.1),),
    )
    return am.Plan(
        mesh={"data": 2, "model": 4},
        specs={"[0]['w']": ("data", None), "[1]['x']": (("data", "model"), None)},
        out_specs={"[1]['w']": ("data", None)},
        constraints={7: (None, "model")},
        microbatches=4,
        zero_stage=1,
        name="megatron_dp",
        predicted=cost,
        provenance=Provenance(searcher="expert", model="mlp", overrides={"layers": 2}),
        assignment={3: "model"},
    )


def test_save_load_round_trip(tmp_path):
    plan = _plan()
    loaded = am.Plan.load(plan.save(tmp_path / "p.json"))
    assert loaded == plan
    assert loaded.devices == 8
    assert loaded.in_specs["[1]['x']"] == PartitionSpec(("data", "model"), None)


def test_unbounded_memory_limit_survives_json(tmp_path):
    plan = _plan()
    import dataclasses
    import math

    cost = dataclasses.replace(plan.predicted, memory_limit_bytes=math.inf)
    loaded = am.Plan.load(dataclasses.replace(plan, predicted=cost).save(tmp_path / "p.json"))
    assert math.isinf(loaded.predicted.memory_limit_bytes)


def test_in_specs_is_a_pytree_when_the_structure_is_known():
    import jax

    args = ({"w": 1.0}, {"x": 2.0})
    plan = am.Plan(
        mesh={"data": 2},
        specs={"[0]['w']": ("data",), "[1]['x']": ()},
        in_tree=jax.tree_util.tree_structure(args),
    )
    assert plan.in_specs == ({"w": PartitionSpec("data")}, {"x": PartitionSpec()})


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a plan"),
        (json.dumps({"schema_version": 99}), "schema version 99"),
        (json.dumps({"schema_version": 1, "mesh": {"data": 2}}), "corrupt"),
        (
            json.dumps({"schema_version": 1, "mesh": {"data": 2}, "specs": {"[0]": [3]}}),
            "corrupt",
        ),
    ],
)
def test_bad_plan_files_get_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(am.PlanError, match=message):
        am.Plan.load(path)


def test_missing_plan_file(tmp_path):
    with pytest.raises(am.PlanError, match="no plan file"):
        am.Plan.load(tmp_path / "nope.json")


def test_assignment_is_a_typed_field_saved_where_plan_files_keep_it(tmp_path):
    plan = _plan()
    raw = plan.to_dict()
    # The file format is unchanged: the assignment is saved among the decisions.
    assert raw["decisions"]["assignment"] == {"3": "model"}
    assert am.Plan.from_dict(raw).assignment == {3: "model"}
    # A hand-written plan has none: the cost model reads it back from the specs.
    del raw["decisions"]["assignment"]
    assert am.Plan.from_dict(raw).assignment is None
    # Built in code the old way, the decisions' assignment becomes the field.
    old = am.Plan(mesh={"data": 8}, specs={}, decisions={"assignment": {"2": "data"}, "x": 1})
    assert old.assignment == {2: "data"} and old.decisions == {"x": 1}


def test_pipelined_means_the_staged_runtime():
    plan = _plan()  # no stages: one program, whatever its microbatches
    assert not plan.pipelined
    one = dataclasses.replace(plan, stages=(Stage(0, 10, tuple(range(8)), {"data": 8}),))
    assert one.pipelined  # one stage, 4 microbatches: gradient accumulation
    assert not dataclasses.replace(one, microbatches=1).pipelined
    two = dataclasses.replace(
        plan,
        stages=(Stage(0, 5, (0, 1, 2, 3), {"data": 4}), Stage(5, 10, (4, 5, 6, 7), {"data": 4})),
    )
    assert two.pipelined


def _piped() -> dict:
    """A two-stage plan's file, as `automap estimate --pp 2 --dp 2` writes one."""
    stages = (Stage(0, 5, (0, 1), {"data": 2}), Stage(5, 10, (2, 3), {"data": 2}))
    plan = dataclasses.replace(_plan(), mesh={"pipe": 2, "data": 2}, stages=stages)
    return plan.to_dict()


def _edited(path: str, value) -> dict:
    raw = json.loads(json.dumps(_piped()))
    *above, key = path.split(".")
    node = raw
    for part in above:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(key) if key.isdigit() else key] = value
    return raw


# Hand edits that keep the JSON valid but break the plan (issue 28): each one line,
# naming the field and the fix, where they once failed deep in apply or the report, or
# ran as if valid.
HAND_EDITS = [
    ("mesh", {"data": 0}, r"mesh\['data'\] must be a whole number of devices >= 1, got 0; give each axis its size"),
    ("mesh", {"data": -2, "model": -4}, r"mesh\['data'\] must be .* got -2"),
    ("mesh", {"data": 2.5}, r"mesh\['data'\] must be a whole number .* got 2\.5"),
    ("mesh", {"data": True}, r"mesh\['data'\] must be a whole number .* got True"),
    ("microbatches", 0, r"microbatches must be a whole number >= 1, got 0; set it to 1"),
    ("remat", "false", r"""remat must be true or false \(a JSON boolean\), got 'false'; write "remat": true or "remat": false"""),
    ("remat", 1, r"remat must be true or false .* got 1"),
    ("zero_stage", 7, r"zero_stage must be 0, 1, 2 or 3, got 7"),
    ("stages.1.devices", [0, 1], r"stages 0 and 1 both run on device 0; each stage needs its own devices"),
    ("mesh", {"pipe": 3, "data": 2}, r"mesh\['pipe'\] is 3 but the plan lists 2 stages; make them agree"),
    ("stages.1.devices", [2, 9], r"stage 1 names device 9, outside the mesh's 4 devices"),
    ("stages.0.devices", [0], r"stage 0 has devices \[0\] but its mesh \{'data': 2\} needs 2 distinct ones"),
    ("stages.0.op_stop", 0, r"stage 0 runs ops 0 to 0, an empty range"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value", "message"), HAND_EDITS)
def test_hand_edited_plans_are_refused_in_one_line(tmp_path, field, value, message):
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(_edited(field, value)))
    with pytest.raises(am.PlanError) as info:
        am.Plan.load(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and len(text.splitlines()) == 1, text
    assert re.search(message, text), text


def test_a_valid_pipeline_plan_loads_as_saved():
    plan = am.Plan.from_dict(_piped())
    assert plan.mesh == {"pipe": 2, "data": 2} and plan.stages[1].devices == (2, 3)
    assert plan.remat is False and am.Plan.from_dict(_edited("remat", True)).remat is True


@pytest.mark.parametrize(("field", "value"), [("mesh", {"data": 0}), ("microbatches", 0)])
def test_a_plan_built_in_code_is_held_to_the_same_sizes(field, value):
    """am.apply on such a plan failed with ZeroDivisionError or an empty NamedSharding."""
    with pytest.raises(am.PlanError, match=rf"^the plan: {field}.* must be a whole number"):
        dataclasses.replace(_plan(), **{field: value})


def test_zero_gather_is_saved_and_a_version_1_file_reads_as_gathering_the_parameters():
    raw = _plan().to_dict()
    assert raw["schema_version"] == 2 and raw["zero_gather"] == "params"
    assert am.Plan.from_dict(dict(raw, zero_gather="compute")).zero_gather == "compute"
    # A file saved before the field ran ZeRO-1/2 gathering the float32 parameters.
    old = {k: v for k, v in raw.items() if k != "zero_gather"} | {"schema_version": 1}
    assert am.Plan.from_dict(old).zero_gather == "params"
    with pytest.raises(am.PlanError, match="zero_gather must be 'params' or 'compute'"):
        am.Plan.from_dict(dict(raw, zero_gather="bf16"))
    with pytest.raises(am.PlanError, match="zero_gather must be"):
        dataclasses.replace(_plan(), zero_gather="")
