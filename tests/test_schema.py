"""The Hydra schemas and the plain dataclasses past the Hydra edge share one field list (``fields_of``): a
value set in a config reaches resolution and the routers unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.config.reading import trainer_from_config
from miles_sglang_plugin.config.schema import MilesTrainerArgs, RouterConf, SGLangDeployConf
from miles_sglang_plugin.config.shared_fields import dict_as_mapping, fields_of, mapping_as_dict
from miles_sglang_plugin.rendering.router_specs import RouterSettings


@dataclasses.dataclass(frozen=True)
class _Source:
    count: int = 3
    name: str | None = None
    table: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hidden: str = dataclasses.field(default="s", repr=False)


def test_fields_of_copies_order_types_defaults_and_options_before_the_own_fields():
    @dataclasses.dataclass
    @fields_of(_Source, retype=mapping_as_dict)
    class Conf:
        own: list[int] = dataclasses.field(default_factory=lambda: [1, 2])

    assert [f.name for f in dataclasses.fields(Conf)] == ["count", "name", "table", "hidden", "own"]
    conf = Conf()
    assert (conf.count, conf.name, conf.table, conf.hidden, conf.own) == (3, None, {}, "s", [1, 2])
    assert Conf().table is not conf.table  # the default factory is copied, not one shared dict
    assert "hidden" not in repr(conf)
    node = OmegaConf.structured(Conf)  # typed: dict, not Mapping, for OmegaConf
    with pytest.raises(ValidationError, match="could not be converted to Integer"):
        node.count = "three"
    node.table = {"k": 1}
    assert OmegaConf.to_object(node) == Conf(table={"k": 1})


def test_fields_of_refuses_a_field_declared_twice():
    with pytest.raises(TypeError, match=r"Twice\.count is already a field of _Source"):

        @fields_of(_Source)
        class Twice:
            count: int = 4


def test_type_mappings_between_dict_and_mapping():
    assert mapping_as_dict(Mapping[str, int]) == dict[str, int]
    assert dict_as_mapping(dict[str, int]) == Mapping[str, int]
    assert mapping_as_dict(int | None) == int | None
    assert dict_as_mapping(list[str]) == list[str]


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
