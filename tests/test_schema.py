"""The Hydra schemas and their frozen twins past the Hydra edge (``MilesTrainerArgs`` and ``TrainerInputs``,
``RouterConf`` and ``RouterSettings``) declare their fields once, in a shared base
(:mod:`miles_sglang_plugin.config.shared_fields`), and so agree on names, order, types (``dict`` there,
``Mapping`` here), defaults, options and docstrings; a field declared again on one side fails here. A value set
in a config reaches resolution and the routers unchanged."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.config.field_docs import field_docs
from miles_sglang_plugin.config.reading import trainer_from_config
from miles_sglang_plugin.config.schema import MilesTrainerArgs, RouterConf, SGLangDeployConf
from miles_sglang_plugin.config.shared_fields import RouterFields, TrainerFields
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.rendering.router_specs import RouterSettings


# ------------------------------------------------------------------------------- twins held to each other
def _as_mapping(hint: Any) -> Any:
    """A schema's ``dict[K, V]`` as the frozen twin's ``Mapping[K, V]`` (OmegaConf types mappings as dict)."""
    if typing.get_origin(hint) is dict:
        return Mapping[typing.get_args(hint)]  # type: ignore[misc]  # a subscript built at run time
    return hint


def _default(one: dataclasses.Field[Any]) -> tuple[str, Any]:
    if one.default_factory is not dataclasses.MISSING:
        return ("factory", one.default_factory())
    return ("value", one.default)


def _differences(schema: type, frozen: type, names: list[str]) -> list[str]:
    """How the fields ``names`` of the Hydra schema and of its frozen twin differ: type (modulo dict as
    Mapping), default, field options, docstring."""
    schema_fields = {f.name: f for f in dataclasses.fields(schema)}
    frozen_fields = {f.name: f for f in dataclasses.fields(frozen)}
    schema_hints, frozen_hints = typing.get_type_hints(schema), typing.get_type_hints(frozen)
    schema_docs, frozen_docs = field_docs(schema), field_docs(frozen)
    out = []
    for name in names:
        one, two = schema_fields[name], frozen_fields[name]
        wanted = _as_mapping(schema_hints[name])
        if wanted != frozen_hints[name]:
            out.append(f"{name}: type {frozen_hints[name]} in the frozen twin, {wanted} wanted")
        if _default(one) != _default(two):
            out.append(f"{name}: default {_default(one)} vs {_default(two)}")
        options = ("init", "repr", "hash", "compare", "kw_only", "metadata")
        if [getattr(one, o) for o in options] != [getattr(two, o) for o in options]:
            out.append(f"{name}: field options differ")
        if schema_docs[name] != frozen_docs[name]:
            out.append(f"{name}: docstring {schema_docs[name]!r} vs {frozen_docs[name]!r}")
    return out


@dataclasses.dataclass
class _Conf:
    count: int = 3
    """How many."""
    table: dict[str, int] = dataclasses.field(default_factory=dict)
    """A table."""


@dataclasses.dataclass(frozen=True)
class _Drifted:
    count: int = 4
    """How many."""
    table: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    """The table."""


def test_the_twins_check_sees_each_kind_of_drift():
    assert _differences(_Conf, _Drifted, ["count", "table"]) == [
        "count: default ('value', 3) vs ('value', 4)",
        "table: type dict[str, int] in the frozen twin, collections.abc.Mapping[str, int] wanted",
        "table: field options differ",
        "table: docstring 'A table.' vs 'The table.'",
    ]


def test_the_root_schema_declares_the_trainer_inputs_one_to_one_then_the_groups_nodes():
    trainer = [f.name for f in dataclasses.fields(TrainerInputs)]
    names = [f.name for f in dataclasses.fields(MilesTrainerArgs)]
    assert names == [*trainer, "sglang", "sglang_deploy", "sglang_bench"]
    assert len(trainer) == 23
    assert _differences(MilesTrainerArgs, TrainerInputs, trainer) == []
    hints = typing.get_type_hints(MilesTrainerArgs)
    assert hints["eval_sglang_overrides"] == dict[str, Any]  # OmegaConf types a mapping node as dict
    assert typing.get_type_hints(TrainerInputs)["eval_sglang_overrides"] == Mapping[str, Any]
    assert (MilesTrainerArgs().seed, MilesTrainerArgs().rollout_num_gpus_per_engine) == (1234, 1)


def test_router_settings_declare_the_router_schemas_fields_one_to_one():
    names = [f.name for f in dataclasses.fields(RouterConf)]
    assert names == [f.name for f in dataclasses.fields(RouterSettings)]
    assert (names[0], names[-2:]) == ("gateway", ["drain_settle_secs", "extra"])
    assert _differences(RouterConf, RouterSettings, names) == []
    assert typing.get_type_hints(RouterSettings)["extra"] == Mapping[str, Any]
    assert (RouterSettings().policy, RouterSettings().request_timeout_secs) == ("cache_aware", 14400)


def _declared_again(cls: type, base: type) -> dict[str, str]:
    """The fields of ``base`` that ``cls`` declares again in its own body, each with why that drifts (a
    redeclaration may only narrow a ``Mapping`` to the ``dict`` OmegaConf types)."""
    base_hints = typing.get_type_hints(base)
    hints = typing.get_type_hints(cls)
    out = {}
    for name in vars(cls).get("__annotations__", {}):
        if name not in base_hints:
            continue
        narrowed = typing.get_origin(hints[name]) is dict and _as_mapping(hints[name]) == base_hints[name]
        if not narrowed:
            out[name] = f"{hints[name]} over {base_hints[name]}"
        elif (
            cls.__dataclass_fields__[name].default_factory
            is not base.__dataclass_fields__[name].default_factory
        ):
            out[name] = "a default other than the base's"
    return out


@pytest.mark.parametrize(
    ("schema", "frozen", "base", "narrowed"),
    [
        (MilesTrainerArgs, TrainerInputs, TrainerFields, ["eval_sglang_overrides"]),
        (RouterConf, RouterSettings, RouterFields, ["extra"]),
    ],
    ids=["trainer", "router"],
)
def test_each_schema_and_its_frozen_twin_derive_from_one_declaration(schema, frozen, base, narrowed):
    assert issubclass(schema, base) and issubclass(frozen, base)
    shared = [f.name for f in dataclasses.fields(base)]
    assert [f.name for f in dataclasses.fields(frozen)] == shared
    assert [f.name for f in dataclasses.fields(schema)][: len(shared)] == shared
    # The Hydra side declares again only the mapping it narrows to dict; the frozen side declares none.
    assert sorted(vars(schema).get("__annotations__", {}).keys() & set(shared)) == narrowed
    assert _declared_again(schema, base) == {}
    assert vars(frozen).get("__annotations__", {}) == {}


def test_the_declared_once_check_sees_a_field_written_again():
    @dataclasses.dataclass
    class Widened(TrainerFields):
        seed: int | None = 1234
        """Base of each engine's --random-seed (Miles: seed + the engine's rank)."""

    @dataclasses.dataclass
    class Narrowed(RouterFields):
        extra: dict[str, Any] = dataclasses.field(default_factory=lambda: {"x": 1})

    assert _declared_again(Widened, TrainerFields) == {"seed": "int | None over <class 'int'>"}
    assert _declared_again(Narrowed, RouterFields) == {"extra": "a default other than the base's"}


@pytest.mark.parametrize("frozen", [TrainerInputs(seed=7), RouterSettings(policy="random")], ids=type)
def test_the_frozen_twins_are_read_only(frozen):
    name = "seed" if isinstance(frozen, TrainerInputs) else "policy"
    before = getattr(frozen, name)
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{name}'"):
        setattr(frozen, name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'added'"):
        frozen.added = 1
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot delete field '{name}'"):
        delattr(frozen, name)
    assert getattr(frozen, name) == before
    assert dataclasses.replace(frozen, **{name: before}) == frozen


def test_trainer_arguments_in_the_root_schema_are_typed_and_reach_trainer_inputs():
    with pytest.raises(CompositionError, match="Value 'abc' of type 'str' could not be converted to Integer"):
        compose_config(["sglang=default", "seed=abc"])
    cfg = compose_config(
        ["sglang=default", "eval_num_gpus=4", "seed=7", "+eval_sglang_overrides.mem_fraction_static=0.5"]
    )
    trainer = trainer_from_config(cfg)
    assert (trainer.eval_num_gpus, trainer.seed, trainer.colocate) == (4, 7, False)
    assert dict(trainer.eval_sglang_overrides) == {"mem_fraction_static": 0.5}


def test_a_subclass_of_the_root_schema_adds_its_own_fields_after_the_trainer_arguments():
    @dataclasses.dataclass
    class TrainConf(MilesTrainerArgs):
        plan_only: bool = False

    names = [f.name for f in dataclasses.fields(TrainConf)]
    assert names[0] == "hf_checkpoint"
    assert names[-4:] == ["sglang", "sglang_deploy", "sglang_bench", "plan_only"]
    node = OmegaConf.structured(TrainConf)
    node.num_gpus_per_node = 4
    with pytest.raises(ValidationError):
        node.plan_only = "maybe"
    assert node.num_gpus_per_node == 4


def test_router_conf_values_reach_router_settings():
    settings = RouterSettings.from_mapping(
        dataclasses.asdict(RouterConf(policy="round_robin", retry_max_retries=2))
    )
    assert (settings.policy, settings.retry_max_retries) == ("round_robin", 2)
    assert settings.health_check_timeout_secs == 5  # the schema's default


def test_plain_deploy_settings_carry_no_interpolation_strings():
    conf = SGLangDeployConf()
    assert conf.api_key is None
    assert "${" not in repr(conf)
