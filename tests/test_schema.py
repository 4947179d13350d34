"""The Hydra schemas mirror the plain dataclasses that the stages past the Hydra edge use: same fields, same
defaults, so that a value set in a config reaches resolution and the routers unchanged."""

from __future__ import annotations

import dataclasses

from miles_sglang_plugin.config.schema import MilesTrainerArgs, RouterConf, SGLangDeployConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.rendering.router_specs import RouterSettings


def _defaults(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_miles_trainer_args_and_trainer_inputs_have_the_same_fields_and_defaults():
    schema = _defaults(MilesTrainerArgs)
    schema.pop("sglang"), schema.pop("sglang_deploy")  # the group's own nodes, not trainer inputs
    assert schema == _defaults(TrainerInputs)


def test_router_conf_and_router_settings_have_the_same_fields_and_defaults():
    assert _defaults(RouterConf) == {
        k: dict(v) if k == "extra" else v for k, v in _defaults(RouterSettings).items()
    }
    settings = RouterSettings.from_mapping(
        dataclasses.asdict(RouterConf(policy="round_robin", retry_max_retries=2))
    )
    assert (settings.policy, settings.retry_max_retries) == ("round_robin", 2)


def test_plain_deploy_settings_carry_no_interpolation_strings():
    conf = SGLangDeployConf()
    assert conf.api_key is None
    assert "${" not in repr(conf)
