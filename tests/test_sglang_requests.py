"""SGLang's request classes of the control routes (read from the installed io_struct.py, or the shipped 0.5.23
description), and every request body the control handle sends checked against them."""

from __future__ import annotations

import importlib.util
from typing import Any

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
from miles_sglang_plugin.serving.ledger import (
    CHECKPOINT,
    ControlState,
    ReplayCall,
    Weights,
    initial_state,
    replay_calls,
)
from tests.test_reconciler_policy import engine

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"
)


def replays() -> list[ReplayCall]:
    """The calls of two replays: from a fresh process to a state with every kind of control state at once, and
    back (resume, unload, continue). Built inside the tests (mutation testing attributes tests by what runs in
    them)."""
    should = ControlState(
        released=frozenset({"weights", "kv_cache"}),
        paused="in_place",
        lora=(("math", "/lora/math", True),),
        weights=Weights.from_disk(control.disk_weights_body("/ckpt/7", weight_version="7")),
        weight_version="8",
    )
    return replay_calls(initial_state(), should) + replay_calls(should, ControlState(weights=CHECKPOINT))


def bodies() -> dict[str, list[dict[str, Any]]]:
    """route -> every body the control handle sends there (through its body builders)."""
    return {
        "/release_memory_occupation": [
            control.memory_body(None),
            control.memory_body(["weights", "kv_cache"]),
        ],
        "/resume_memory_occupation": [control.memory_body(["cuda_graph"])],
        "/update_weights_from_disk": [
            control.disk_weights_body("/ckpt"),
            control.disk_weights_body(
                "/ckpt", weight_version="3", load_format="auto", abort_all_requests=True, flush_cache=False
            ),
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
            control.distributed_weights_body(
                ["w"],
                ["bfloat16"],
                [[1]],
                group_name="g",
                weight_version="9",
                flush_cache=True,
                abort_all_requests=True,
                load_format="flattened_bucket",
            ),
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
    every = bodies()
    assert set(every) == set(ROUTE_REQUESTS)
    # Every operation's route has its request class, but /flush_cache, which reads no body.
    assert {s.route for s in control.OPERATIONS.values() if s.route} == {*ROUTE_REQUESTS, "/flush_cache"}
    for route, sent in every.items():
        for body in sent:
            assert schemas.problems(route, body) == [], (schemas.source, route, body)


@pytest.mark.parametrize("source", ["installed or shipped", "shipped"])
def test_every_replayed_body_fits_sglangs_request_class(source: str) -> None:
    schemas = load_request_schemas() if source != "shipped" else _shipped()
    calls = replays()
    routes = [call.route for call in calls]
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
    for call in calls:
        assert schemas.problems(call.route, dict(call.body)) == [], (schemas.source, call.route, call.body)


def test_distributed_bodies_name_dtypes_without_torch() -> None:
    body = bodies()["/update_weights_from_distributed"][0]
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


# --------------------------------------------------------------------------------- the operations table
def _row(**flags: bool) -> Any:
    row = engine("e")
    row.needs_offload = flags.get("needs_offload", False)
    row.update_weights = flags.get("update_weights", False)
    row.serves_lora = flags.get("serves_lora", False)
    return row


def test_each_operation_concerns_the_engines_the_plan_gave_it() -> None:
    """The docs' table (docs/serve.md): offload/onload the groups with needs_offload; the weight operations the
    models with update_weights; LoRA the engines serving LoRA; the rest every engine."""
    plain, offloaded = _row(), _row(needs_offload=True)
    weights, lora = _row(update_weights=True), _row(serves_lora=True)
    concerned = {
        name: tuple(spec.concerns(row) for row in (plain, offloaded, weights, lora))
        for name, spec in control.OPERATIONS.items()
    }
    every = (True, True, True, True)
    offload = (False, True, False, False)
    weight = (False, False, True, False)
    adapters = (False, False, False, True)
    assert concerned == {
        "offload": offload,
        "onload": offload,
        "update_weights_from_disk": weight,
        "init_weights_update_group": weight,
        "update_weights_from_distributed": weight,
        "destroy_weights_update_group": weight,
        "update_weight_version": weight,
        "pause_generation": every,
        "continue_generation": every,
        "flush_cache": every,
        "abort_all": every,
        "load_lora_adapter": adapters,
        "unload_lora_adapter": adapters,
        "query": every,
    }
    recorded = {name for name, spec in control.OPERATIONS.items() if spec.records}
    assert recorded == {
        "offload",
        "onload",
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weight_version",
        "pause_generation",
        "continue_generation",
        "load_lora_adapter",
        "unload_lora_adapter",
    }
    assert {name for name, spec in control.OPERATIONS.items() if spec.method != "POST"} == {"query"}


# ------------------------------------------------------------------------------------------ arguments
def test_a_deadline_is_a_finite_number_of_seconds_above_zero() -> None:
    assert control.check_timeout(None) is None
    assert control.check_timeout(5) == 5.0 and isinstance(control.check_timeout(5), float)
    assert control.check_timeout(0.25) == 0.25
    for bad in (0, 0.0, -1, float("inf"), float("-inf"), float("nan"), True, False, "5", [5]):
        with pytest.raises(ValueError, match="timeout_s must be"):
            control.check_timeout(bad)  # type: ignore[arg-type]


def test_memory_tags_are_sglangs_once_each_or_none_for_all() -> None:
    assert control.memory_tags(None) is None
    assert control.memory_tags("weights") == ("weights",)
    assert control.memory_tags(["kv_cache", "weights", "kv_cache"]) == ("kv_cache", "weights")
    assert control.memory_tags(("cuda_graph",)) == ("cuda_graph",)
    for bad in ([], "gpu", ["weights", "gpu"], "kv"):
        with pytest.raises(ValueError, match="memory tags must be some of weights, kv_cache, cuda_graph"):
            control.memory_tags(bad)


def test_a_version_is_a_string_or_an_integer() -> None:
    assert control.check_version("3") == "3" and control.check_version(12) == "12"
    for bad in (None, True, 1.5, ["1"]):
        with pytest.raises(ValueError, match=r"^new_version must be a string \(or an integer\)"):
            control.check_version(bad)
    with pytest.raises(ValueError, match=r"^weight_version must be"):
        control.check_version(None, "weight_version")


def test_a_pause_takes_one_of_sglangs_modes() -> None:
    assert [control.pause_body(m) for m in ("abort", "retract", "in_place")] == [
        {"mode": "abort"},
        {"mode": "retract"},
        {"mode": "in_place"},
    ]
    with pytest.raises(ValueError, match="pause mode 'pause' is not one of abort, retract, in_place"):
        control.pause_body("pause")


# --------------------------------------------------------------------------------------- request bodies
def test_the_request_bodies() -> None:
    assert control.memory_body(None) == {} and control.memory_body(("weights", "kv_cache")) == {
        "tags": ["weights", "kv_cache"]
    }
    assert control.disk_weights_body("/ckpt") == {
        "model_path": "/ckpt",
        "abort_all_requests": False,
        "flush_cache": True,
    }
    assert control.disk_weights_body(
        "/ckpt", weight_version=3, load_format="auto", abort_all_requests=True
    ) == {  # type: ignore[arg-type]
        "model_path": "/ckpt",
        "abort_all_requests": True,
        "flush_cache": True,
        "weight_version": "3",
        "load_format": "auto",
    }
    assert control.disk_weights_body("/c", flush_cache=False)["flush_cache"] is False
    assert control.distributed_weights_body(["a.weight"], ["torch.float16"], [(2, 3)]) == {
        "names": ["a.weight"],
        "dtypes": ["float16"],
        "shapes": [[2, 3]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "abort_all_requests": False,
    }
    assert control.distributed_weights_body(
        ("w",),
        ("bfloat16",),
        ([1],),
        group_name="g",
        weight_version=9,  # type: ignore[arg-type]
        flush_cache=True,
        abort_all_requests=True,
        load_format="flattened_bucket",
    ) == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[1]],
        "group_name": "g",
        "flush_cache": True,
        "abort_all_requests": True,
        "weight_version": "9",
        "load_format": "flattened_bucket",
    }
    assert control.init_group_body(
        master_address="10.0.0.1",
        master_port=29500,
        rank_offset=3,
        world_size=5,
        group_name="g",
        backend="gloo",
    ) == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 3,
        "world_size": 5,
        "group_name": "g",
        "backend": "gloo",
    }
    assert control.weight_version_body(12) == {"new_version": "12", "abort_all_requests": False}  # type: ignore[arg-type]
    assert control.weight_version_body("4", abort_all_requests=True) == {
        "new_version": "4",
        "abort_all_requests": True,
    }
    assert control.lora_load_body("m", "/l/m") == {"lora_name": "m", "lora_path": "/l/m", "pinned": False}
    assert control.lora_load_body("m", "/l/m", pinned=True)["pinned"] is True
    assert control.lora_unload_body("m") == {"lora_name": "m"}


def test_dtypes_are_named_without_torch() -> None:
    class Dtype:
        def __str__(self) -> str:
            return "torch.bfloat16"

    body = control.distributed_weights_body(
        ["a", "b", "c"], [Dtype(), "torch.float32", "int8"], [[1], [2], [3]]
    )
    assert body["dtypes"] == ["bfloat16", "float32", "int8"]


# ---------------------------------------------------------------------------------------------- effects
def test_what_each_operation_leaves_an_engine_with() -> None:
    start = ControlState(released=frozenset({"kv_cache"}), weight_version="1", lora=(("m", "/m", False),))
    everything = frozenset({"weights", "kv_cache", "cuda_graph"})
    assert control.memory_effect(None, released=True)(start).released == everything
    assert control.memory_effect(["weights"], released=True)(start).released == {"weights", "kv_cache"}
    assert control.memory_effect(["kv_cache"], released=False)(start).released == frozenset()
    assert (
        control.memory_effect(None, released=False)(start.__class__(released=everything)).released
        == frozenset()
    )
    body = control.disk_weights_body("/ckpt/5", weight_version="5", abort_all_requests=True)
    assert control.disk_weights_effect(body)(start) == ControlState(
        released=frozenset({"kv_cache"}),
        weights=Weights.from_disk({"model_path": "/ckpt/5", "flush_cache": True, "weight_version": "5"}),
        weight_version="5",
        lora=(("m", "/m", False),),
    )  # whether requests were aborted is no part of the weights
    plain = control.disk_weights_effect(control.disk_weights_body("/c"))(start)
    assert (plain.weights.disk_body, plain.weight_version) == ({"model_path": "/c", "flush_cache": True}, "1")
    assert control.weight_version_effect("7")(start).weight_version == "7"
    assert control.pause_effect("abort")(start).paused == "abort"
    assert control.pause_effect(None)(ControlState(paused="abort")).paused is None
    assert control.lora_load_effect("a", "/a", True)(start).lora == (("a", "/a", True), ("m", "/m", False))
    assert control.lora_unload_effect("m")(start).lora == ()
