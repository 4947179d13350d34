"""SGLang's request classes of the control routes (read from the installed io_struct.py, or the shipped 0.5.23
description), and every request body the control handle sends checked against them."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_sglang_plugin.rendering.sglang_requests import (
    ROUTE_REQUESTS,
    _shipped,
    _type_tree,
    load_request_schemas,
    schemas_from_source,
    value_matches,
)
from miles_sglang_plugin.serving import operations as control
from miles_sglang_plugin.serving.ledger import CHECKPOINT, ControlState, Weights, initial_state, replay_calls

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"
)

#: What a restarted engine is replayed to reach: every kind of state at once.
SHOULD = ControlState(
    released=frozenset({"weights", "kv_cache"}),
    paused="in_place",
    lora=(("math", "/lora/math", True),),
    weights=Weights.from_disk(control.disk_weights_body("/ckpt/7", weight_version="7")),
    weight_version="8",
)
#: The calls of two replays: from a fresh process to SHOULD, and back (resume, unload, continue).
REPLAYS = replay_calls(initial_state(), SHOULD) + replay_calls(SHOULD, ControlState(weights=CHECKPOINT))

#: route -> every body the control handle sends there (through its body builders).
BODIES = {
    "/release_memory_occupation": [control.memory_body(None), control.memory_body(["weights", "kv_cache"])],
    "/resume_memory_occupation": [control.memory_body(["cuda_graph"])],
    "/update_weights_from_disk": [
        control.disk_weights_body("/ckpt"),
        control.disk_weights_body("/ckpt", weight_version="3", load_format="auto", abort_all_requests=True),
    ],
    "/init_weights_update_group": [
        control.init_group_body(
            master_address="10.0.0.1",
            master_port=29500,
            rank_offset=1,
            world_size=9,
            group_name="miles-pp_0",
            backend="nccl",
        )
    ],
    "/update_weights_from_distributed": [
        control.distributed_weights_body(
            ["a.weight", "b.bias"], ["torch.bfloat16", "float32"], [[4, 4], [4]]
        ),
        control.distributed_weights_body(["w"], ["bfloat16"], [[1]], group_name="g", weight_version="9"),
    ],
    "/destroy_weights_update_group": [{"group_name": "miles-pp_0"}],
    "/update_weight_version": [control.weight_version_body("12", abort_all_requests=True)],
    "/pause_generation": [control.pause_body(mode) for mode in control.PAUSE_MODES],
    "/continue_generation": [{}],
    "/abort_request": [{"abort_all": True}],
    "/load_lora_adapter": [control.lora_load_body("math", "/lora/math", pinned=True)],
    "/unload_lora_adapter": [control.lora_unload_body("math")],
}


@pytest.mark.parametrize("source", ["installed or shipped", "shipped"])
def test_every_control_body_fits_sglangs_request_class(source: str) -> None:
    schemas = load_request_schemas() if source != "shipped" else _shipped()
    assert set(BODIES) == set(ROUTE_REQUESTS)
    # Every operation's route has its request class, but /flush_cache, which reads no body.
    assert {s.route for s in control.OPERATIONS.values() if s.route} == {*ROUTE_REQUESTS, "/flush_cache"}
    for route, bodies in BODIES.items():
        for body in bodies:
            assert schemas.problems(route, body) == [], (schemas.source, route, body)


@pytest.mark.parametrize("source", ["installed or shipped", "shipped"])
def test_every_replayed_body_fits_sglangs_request_class(source: str) -> None:
    schemas = load_request_schemas() if source != "shipped" else _shipped()
    routes = [call.route for call in REPLAYS]
    assert routes == [
        "/load_lora_adapter",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/release_memory_occupation",
        "/pause_generation",
        "/resume_memory_occupation",
        "/unload_lora_adapter",
        "/continue_generation",
    ]
    for call in REPLAYS:
        assert schemas.problems(call.route, dict(call.body)) == [], (schemas.source, call.route, call.body)


def test_distributed_bodies_name_dtypes_without_torch() -> None:
    body = BODIES["/update_weights_from_distributed"][0]
    assert body["dtypes"] == ["bfloat16", "float32"] and body["shapes"] == [[4, 4], [4]]
    assert body["flush_cache"] is False  # as Miles sends it: the cache is flushed once, by the pause


@pytest.mark.sglang
@needs_sglang
def test_the_shipped_description_is_the_installed_sglangs() -> None:
    installed = load_request_schemas()
    assert installed.source.startswith("sglang 0.5.23 (")
    assert installed.classes == _shipped().classes


def test_fields_read_from_source_include_inherited_ones_and_defaults() -> None:
    source = """
class BaseReq(msgspec.Struct, tag=True, kw_only=True):
    rid: Optional[str] = None

class UpdateWeightVersionReqInput(BaseReq, kw_only=True):
    new_version: str
    abort_all_requests: bool = True
    KIND: ClassVar[str] = "x"
"""
    (schema,) = schemas_from_source(source, ("UpdateWeightVersionReqInput",)).values()
    assert [(f.name, f.annotation, f.required) for f in schema.fields] == [
        ("rid", "Optional[str]", False),
        ("new_version", "str", True),
        ("abort_all_requests", "bool", False),
    ]
    assert schema.problems({"new_version": "1", "abort_all_requests": 1}) == [
        "UpdateWeightVersionReqInput.abort_all_requests must be bool, got 1"
    ]
    assert schema.problems([]) == [
        "the body of a UpdateWeightVersionReqInput must be a JSON object, got list"
    ]


def test_the_shipped_classes_have_sglangs_required_fields() -> None:
    classes = _shipped().classes
    required = {name: [f.name for f in schema.fields if f.required] for name, schema in classes.items()}
    assert required["UpdateWeightFromDiskReqInput"] == ["model_path"]
    assert required["InitWeightsUpdateGroupReqInput"] == [
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
    ]
    assert required["UpdateWeightsFromDistributedReqInput"] == ["names", "dtypes", "shapes"]
    assert required["UpdateWeightVersionReqInput"] == ["new_version"]
    assert required["LoadLoRAAdapterReqInput"] == ["lora_name", "lora_path"]
    assert required["ReleaseMemoryOccupationReqInput"] == required["PauseGenerationReqInput"] == []


@pytest.mark.parametrize(
    ("annotation", "good", "bad"),
    [
        ("Optional[List[str]]", [None, [], ["a"]], [["a", 1], "a", [None]]),
        ("Literal['abort', 'retract', 'in_place']", ["abort", "in_place"], ["pause", 1, None]),
        ("List[List[int]]", [[[1, 2], []]], [[[1.5]], [[True]]]),
        ("float", [1, 1.5], [True, "1"]),
        ("int", [0, -3], [True, 1.0]),
        ("Dict[str, Any]", [{}, {"a": [1]}], [[], "x"]),
        ("str | None", ["x", None], [1]),
        ("Annotated[List[bytes], Base64Bytes()]", [["YQ=="]], [[1]]),
        ("Optional[WeightVersionSpans]", [None, {"any": "thing"}, 3], []),
    ],
)
def test_values_against_annotations(annotation: str, good: list, bad: list) -> None:
    tree = _type_tree(annotation)
    assert [value_matches(v, tree) for v in good] == [True] * len(good)
    assert [value_matches(v, tree) for v in bad] == [False] * len(bad)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=3),
        lambda kids: st.lists(kids, max_size=3),
        max_leaves=8,
    )
)
def test_a_bool_is_never_a_number_and_anything_fits_any(value: object) -> None:
    assert value_matches(value, ("any",))
    if isinstance(value, bool):
        assert not value_matches(value, _type_tree("int")) and not value_matches(value, _type_tree("float"))
