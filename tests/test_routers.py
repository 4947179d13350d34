"""routers.py / router_main.py / router_client.py: unit tests, then integration tests against a REAL router
(sglang-router 0.3.2, or SMG 1.13.0 with ``--gateway smg``).

Integration tests start the router through ``router_command`` (``python -m miles_sglang_plugin.serving.router_main``)
and stand-in engines (``python -m miles_sglang_plugin.standin``) on 127.0.0.1 with ports found free by binding
port 0, and talk to the router through the client the reconciler uses (``serving/router_client.py`` on a
``ClientPool``, each call on an event loop of its own: ``tests/router_helpers.py``). Every process gets its
own session (process group) and is killed by group and reaped in a fixture finalizer; the last test checks
that nothing is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.rendering.router_specs import (
    GATEWAY_ENV,
    GATEWAYS,
    RouterLaunchSpec,
    RouterSettings,
    WorkerRegistration,
    gateway_info,
    gateway_installed,
    gateway_version,
    resolve_gateway,
    validate_router_settings,
)
from miles_sglang_plugin.serving import router_main
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry
from miles_sglang_plugin.serving.router_client import SharedReads, deregister, listed, register, workers_of
from miles_sglang_plugin.serving.routers import API_KEY_ENV, router_command
from miles_sglang_plugin.serving.wire import ClientPool
from tests.router_helpers import on_router, router_workers

REPO = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-router-key-do-not-leak"


def _spec(**kw) -> RouterLaunchSpec:
    base = dict(model="actor", host="127.0.0.1", port=30100, prometheus_port=30101, pd_disaggregation=False)
    base.update(kw)
    return RouterLaunchSpec(**base)


# ==========================================================================================================
# Unit tests
# ==========================================================================================================


def test_router_command_keeps_key_out_of_argv() -> None:
    spec = _spec(api_key=SECRET, settings=RouterSettings(policy="consistent_hashing"))
    argv, env = router_command(spec, python="/usr/bin/python3")
    assert argv[:3] == ["/usr/bin/python3", "-m", "miles_sglang_plugin.serving.router_main"]
    assert not any(SECRET in a for a in argv)
    assert env[API_KEY_ENV] == SECRET
    assert API_KEY_ENV == "MSP_ROUTER_API_KEY"
    i = argv.index("--spec-json")
    data = json.loads(argv[i + 1])
    assert data["api_key_in_env"] is True and "api_key" not in data
    again = RouterLaunchSpec.from_json(argv[i + 1], api_key=env[API_KEY_ENV])
    assert again == spec


def test_router_command_without_key() -> None:
    spec = _spec()
    argv, env = router_command(spec)
    assert argv[0] == sys.executable
    assert API_KEY_ENV not in env
    assert json.loads(argv[argv.index("--spec-json") + 1])["api_key_in_env"] is False
    assert RouterLaunchSpec.from_json(argv[-1]) == spec


def test_repr_masks_key() -> None:
    spec = _spec(api_key=SECRET)
    for text in (repr(spec), str(spec), f"{spec}", f"{spec!r}", repr([spec])):
        assert SECRET not in text
        assert "api_key='***'" in text
    assert "api_key=None" in repr(_spec())
    assert SECRET not in spec.to_json()


def test_spec_validation_and_url() -> None:
    assert _spec(host="::1").url == "http://[::1]:30100"
    assert _spec(host="[::1]").host == "::1"
    with pytest.raises(ValueError, match="must differ"):
        _spec(prometheus_port=30100)
    with pytest.raises(ValueError, match="port"):
        _spec(port=0)
    with pytest.raises(ValueError, match="api_key"):
        _spec(api_key="")
    route = ModelRoute.from_launch_spec(
        _spec(settings=RouterSettings(policy="manual"), pd_disaggregation=True)
    )
    assert (route.name, route.base_url, route.policy, route.pd_disaggregation) == (
        "actor",
        "http://127.0.0.1:30100",
        "manual",
        True,
    )


def test_gateway_auto_is_the_variable_then_smg_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_sglang_plugin.rendering import router_specs

    assert (resolve_gateway("sglang_router"), resolve_gateway("smg")) == ("sglang_router", "smg")
    monkeypatch.setenv(GATEWAY_ENV, "smg")
    assert resolve_gateway("auto") == "smg"
    assert resolve_gateway("sglang_router") == "sglang_router"  # an explicit choice is not overridden
    monkeypatch.setenv(GATEWAY_ENV, "sglang_router")
    assert resolve_gateway("auto") == "sglang_router"
    monkeypatch.delenv(GATEWAY_ENV)
    monkeypatch.setattr(router_specs, "gateway_installed", lambda name: name == "smg")
    assert resolve_gateway("auto") == "smg"
    monkeypatch.setattr(router_specs, "gateway_installed", lambda name: False)
    assert resolve_gateway("auto") == "sglang_router"
    settings = RouterSettings(policy="random", extra={"dp_aware": True})
    assert settings.resolved() == RouterSettings(
        gateway="sglang_router", policy="random", extra={"dp_aware": True}
    )


def test_gateway_setting_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_sglang_plugin.rendering import router_specs

    assert validate_router_settings(RouterSettings(gateway="sglang-router")) == [
        "gateway: 'sglang-router' is not one of auto, sglang_router, smg"
    ]
    monkeypatch.setenv(GATEWAY_ENV, "vllm")
    assert validate_router_settings(RouterSettings()) == [
        "gateway: auto, but $MSP_ROUTER_GATEWAY='vllm' is not one of sglang_router, smg"
    ]
    monkeypatch.setenv(GATEWAY_ENV, "sglang_router")
    monkeypatch.setattr(router_specs, "gateway_installed", lambda name: name == "sglang_router")
    assert validate_router_settings(RouterSettings(gateway="smg")) == [
        "gateway: smg is not installed: pip install 'miles_sglang_plugin[smg]', or choose sglang_router"
    ]
    monkeypatch.setenv(GATEWAY_ENV, "smg")
    assert validate_router_settings(RouterSettings(gateway="auto")) == [
        "gateway: auto is smg here ($MSP_ROUTER_GATEWAY=smg), which is not installed: pip install "
        "'miles_sglang_plugin[smg]', or set $MSP_ROUTER_GATEWAY to another gateway"
    ]


def test_plan_names_each_routers_gateway(capsys: pytest.CaptureFixture[str], test_gateway: str) -> None:
    from miles_sglang_plugin import cli

    assert cli.main(["plan", "sglang_deploy.router.gateway=sglang-router", "hf_checkpoint=/c"]) == 2
    assert (
        "  - sglang_deploy.router: gateway: 'sglang-router' is not one of auto, sglang_router, smg"
        in capsys.readouterr().err.splitlines()
    )
    for choice, expected in (("sglang_router", "sglang_router"), ("auto", test_gateway)):
        assert cli.main(["plan", "--json", f"sglang_deploy.router.gateway={choice}", "hf_checkpoint=/c"]) == 0
        router = json.loads(capsys.readouterr().out)["models"]["actor"]["router"]
        assert (router["gateway"], router["dp_aware"]) == (expected, False)


def test_gateway_versions_are_the_installed_distributions() -> None:
    # sglang-router is pinned <0.4 and tested at 0.3.2; SMG's module says 1.1.0 in 1.13.0 (its __version__ is
    # not the package's), so the distribution is asked
    assert gateway_version("sglang_router") == "0.3.2"
    if gateway_installed("smg"):
        import smg

        assert gateway_version("smg") == "1.13.0" and smg.__version__ == "1.1.0"
    assert [gateway_info(name).tested_version for name in GATEWAYS] == ["0.3.2", "1.13.0"]


@pytest.mark.skipif(not gateway_installed("smg"), reason="SMG is not installed (the [smg] extra)")
def test_smg_policies() -> None:
    valid = (
        "cache_aware, round_robin, power_of_two, random, manual, consistent_hashing, prefix_hash, least_load, "
        "passthrough"
    )
    for policy in ("prefix_hash", "least_load", "passthrough", "consistent_hashing"):
        assert validate_router_settings(RouterSettings(gateway="smg", policy=policy)) == []
    assert validate_router_settings(RouterSettings(gateway="smg", policy="least-load")) == [
        f"policy: unknown policy 'least-load'; valid: {valid} (did you mean least_load?)"
    ]
    assert validate_router_settings(RouterSettings(gateway="smg", prefill_policy="bucket")) == []
    assert validate_router_settings(RouterSettings(gateway="smg", extra={"zzzz": 1})) == [
        "extra.zzzz: not a SMG RouterArgs field"
    ]


def test_validate_default_settings_clean() -> None:
    assert validate_router_settings(RouterSettings()) == []
    for policy in ("round_robin", "cache_aware", "power_of_two", "random", "manual", "consistent_hashing"):
        assert validate_router_settings(RouterSettings(policy=policy)) == []
    # prefill/decode policies without PD are fine; bucket is fine for prefill
    ok = RouterSettings(prefill_policy="bucket", decode_policy="power_of_two")
    assert validate_router_settings(ok) == []


def test_validate_unknown_policy_lists_valid_ones() -> None:
    (msg,) = validate_router_settings(RouterSettings(gateway="sglang_router", policy="round-robin"))
    assert "policy: unknown policy 'round-robin'" in msg
    assert "valid: cache_aware, round_robin, power_of_two, random, manual, consistent_hashing" in msg
    assert "did you mean round_robin" in msg
    (msg,) = validate_router_settings(RouterSettings(gateway="sglang_router", policy="prefix_hash"))
    assert "503" in msg


def test_validate_bucket_only_for_prefill() -> None:
    (msg,) = validate_router_settings(RouterSettings(policy="bucket"))
    assert msg.startswith("policy: 'bucket' is only valid as prefill_policy")
    (msg,) = validate_router_settings(RouterSettings(decode_policy="bucket"))
    assert msg.startswith("decode_policy: 'bucket' is only valid as prefill_policy")
    (msg,) = validate_router_settings(RouterSettings(prefill_policy="buckets"))
    assert "prefill_policy: unknown policy 'buckets'" in msg and "bucket" in msg


def test_validate_extra_keys() -> None:
    settings = RouterSettings(
        gateway="sglang_router",
        extra={
            "cache_treshold": 0.5,  # typo
            "balance_abs_threshold": 10,  # fine
            "host": "0.0.0.0",  # managed by the spec
            "api_key": "x",  # secret: must go through the spec
            "policy": "random",  # typed setting
            "cache_threshold": "high",  # wrong type
            "worker_urls": ["http://w:1"],  # workers come through POST /workers
        },
    )
    problems = validate_router_settings(settings)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "extra.cache_treshold: not a sglang-router RouterArgs field; did you mean cache_threshold" in text
    assert "extra.host: not allowed here: set by the launch spec" in text
    assert "extra.api_key: not allowed here: pass it as RouterLaunchSpec.api_key" in text
    assert "extra.policy: set 'policy' directly" in text
    assert "extra.cache_threshold: expected float, got 'high'" in text
    assert "extra.worker_urls: not allowed here: workers are registered through POST /workers" in text
    assert "balance_abs_threshold" not in text


def test_validate_other_fields() -> None:
    problems = validate_router_settings(
        RouterSettings(log_level="warning", health_check_interval_secs=0, disable_retries="yes")  # type: ignore[arg-type]
    )
    text = "\n".join(problems)
    assert "log_level: 'warning' is not one of debug, info, warn, error (did you mean 'warn'?)" in text
    assert "health_check_interval_secs: must be an integer in 1..2592000 (at most 30 days), got 0" in text
    assert "disable_retries: must be true or false" in text


def test_drain_settle_secs_is_a_duration_from_zero() -> None:
    assert RouterSettings().drain_settle_secs == 0
    assert validate_router_settings(RouterSettings(drain_settle_secs=5)) == []
    assert validate_router_settings(RouterSettings(drain_settle_secs=-1)) == [
        "drain_settle_secs: must be an integer in 0..2592000 (at most 30 days), got -1"
    ]


def test_the_shutdown_grace_period_is_a_duration_from_zero() -> None:
    assert RouterSettings().shutdown_grace_period_secs == 0
    assert validate_router_settings(RouterSettings(shutdown_grace_period_secs=30)) == []
    assert validate_router_settings(RouterSettings(shutdown_grace_period_secs=-1)) == [
        "shutdown_grace_period_secs: must be an integer in 0..2592000 (at most 30 days), got -1"
    ]


def test_validate_never_raises_on_garbage() -> None:
    s = RouterSettings(policy=None, extra={1: 2, "max_tree_size": object()})  # type: ignore[arg-type, dict-item]
    problems = validate_router_settings(s)
    assert any("policy" in p for p in problems)
    assert any("key 1 is not a string" in p for p in problems)
    assert any("max_tree_size" in p for p in problems)


def test_settings_from_mapping_and_immutability() -> None:
    s = RouterSettings.from_mapping({"policy": "round_robin", "extra": {"dp_aware": True}})
    assert s.policy == "round_robin" and s.extra["dp_aware"] is True
    with pytest.raises(TypeError, match="does not support item assignment"):
        s.extra["x"] = 1  # type: ignore[index]
    src = {"a": 1}
    s2 = RouterSettings(extra=src)
    src["b"] = 2
    assert dict(s2.extra) == {"a": 1}
    with pytest.raises(ValueError, match="did you mean policy"):
        RouterSettings.from_mapping({"polcy": "x"})
    assert RouterSettings.from_mapping(s.to_dict()) == s


def test_worker_registration_normalises_and_validates() -> None:
    assert WorkerRegistration("http://h:1/").url == "http://h:1"
    assert WorkerRegistration("h:1").url == "http://h:1"
    w = WorkerRegistration("http://h:1", "prefill", 8998)
    assert w.payload() == {"url": "http://h:1", "worker_type": "prefill", "bootstrap_port": 8998}
    assert w.payload("k")["api_key"] == "k"
    assert WorkerRegistration("http://h:2", "decode").payload() == {
        "url": "http://h:2",
        "worker_type": "decode",
    }
    with pytest.raises(ValueError, match="worker_type"):
        WorkerRegistration("http://h:1", "bogus")
    with pytest.raises(ValueError, match="only for prefill"):
        WorkerRegistration("http://h:1", "decode", 8998)
    with pytest.raises(ValueError, match="bootstrap_port"):
        WorkerRegistration("http://h:1", "prefill", 0)


def test_settings_from_mapping_fills_in_what_is_missing() -> None:
    assert RouterSettings.from_mapping({}) == RouterSettings()
    # extra: null in YAML (or a Hydra node) means no extra settings
    settings = RouterSettings.from_mapping({"policy": "random", "extra": None})
    assert settings.policy == "random" and dict(settings.extra) == {}


def test_unknown_setting_message_offers_at_most_three_real_names() -> None:
    with pytest.raises(ValueError) as info:
        RouterSettings.from_mapping({"zzzz": 1})
    assert str(info.value) == "unknown router setting(s) 'zzzz'; other RouterArgs fields go under 'extra'"
    # "disable_timeout_secs" is close to several settings (disable_*, *_timeout_secs): three are offered
    with pytest.raises(ValueError) as info:
        RouterSettings.from_mapping({"disable_timeout_secs": 1})
    match = re.fullmatch(
        r"unknown router setting\(s\) 'disable_timeout_secs' \(did you mean (\w+), (\w+), (\w+)\?\); "
        r"other RouterArgs fields go under 'extra'",
        str(info.value),
    )
    assert match, str(info.value)
    names = set(match.groups())
    assert len(names) == 3 and names <= set(RouterSettings().to_dict())
    assert all("disable" in name or "timeout" in name for name in names)


def test_spec_refuses_an_empty_or_non_string_model_and_host() -> None:
    for model in ("", 5, None):
        with pytest.raises(ValueError, match="model must be a non-empty string"):
            _spec(model=model)
    for host in ("", "[]", 5, None):
        with pytest.raises(ValueError, match="host must be a non-empty string"):
            _spec(host=host)
    # single-label host names are host names, whatever their letters
    for host in ("X", "node7", "localhost"):
        assert _spec(host=host).host == host


def test_spec_ports_are_1_to_65535() -> None:
    for name, other in (("port", "prometheus_port"), ("prometheus_port", "port")):
        for good in (1, 65535):
            assert getattr(_spec(**{name: good, other: 2000}), name) == good
        for bad in (0, 65536, -1, True, "30100", 30100.0):
            with pytest.raises(ValueError, match=re.escape(f"{name} must be an integer in 1..65535")):
                _spec(**{name: bad, other: 2000})


def test_spec_json_keys_are_sorted_so_equal_specs_give_equal_commands() -> None:
    one = _spec(settings=RouterSettings(extra={"dp_aware": True, "balance_abs_threshold": 10}))
    two = _spec(settings=RouterSettings(extra={"balance_abs_threshold": 10, "dp_aware": True}))
    assert one == two and one.to_json() == two.to_json()
    data = json.loads(one.to_json())  # json keeps the text's order
    assert list(data) == [
        "api_key_in_env",
        "host",
        "model",
        "pd_disaggregation",
        "port",
        "prometheus_port",
        "settings",
    ]
    assert list(data["settings"]) == sorted(data["settings"])
    assert list(data["settings"]["extra"]) == ["balance_abs_threshold", "dp_aware"]


def test_spec_from_hand_written_json() -> None:
    # neither api_key_in_env nor settings: both optional
    text = '{"model": "actor", "host": "127.0.0.1", "port": 30100, "prometheus_port": 30101, "pd_disaggregation": false}'
    assert RouterLaunchSpec.from_json(text) == _spec()
    with_null = text[:-1] + ', "settings": null}'
    assert RouterLaunchSpec.from_json(with_null).settings == RouterSettings()
    with_key = text[:-1] + f', "api_key": "{SECRET}"}}'
    with pytest.raises(ValueError) as info:
        RouterLaunchSpec.from_json(with_key, api_key=SECRET)
    assert str(info.value) == "router spec JSON must not contain the API key"
    with pytest.raises(ValueError, match="must be an object"):
        RouterLaunchSpec.from_json("[1, 2]")


def test_worker_registration_refuses_empty_urls_and_bad_bootstrap_ports() -> None:
    for url in ("", "   ", 5, None):
        with pytest.raises(ValueError, match="worker url must be a non-empty string"):
            WorkerRegistration(url)  # type: ignore[arg-type]
    assert WorkerRegistration("  http://nodeX/  ").url == "http://nodeX"
    assert WorkerRegistration("nodeX:8000//").url == "http://nodeX:8000"
    for good in (1, 65535):
        assert WorkerRegistration("http://h:1", "prefill", good).bootstrap_port == good
    for bad in (0, 65536, True, "8998"):
        with pytest.raises(ValueError, match=re.escape("bootstrap_port must be an integer in 1..65535")):
            WorkerRegistration("http://h:1", "prefill", bad)  # type: ignore[arg-type]


def test_worker_registration_describe() -> None:
    assert (
        WorkerRegistration("h:1", "prefill", 8998).describe() == "http://h:1 (prefill, bootstrap_port=8998)"
    )
    assert WorkerRegistration("h:1", "prefill").describe() == "http://h:1 (prefill)"
    assert WorkerRegistration("http://h:2/").describe() == "http://h:2 (regular)"


def test_policy_messages_in_full() -> None:
    valid = "cache_aware, round_robin, power_of_two, random, manual, consistent_hashing"

    def problems(**settings: object) -> list[str]:
        return validate_router_settings(RouterSettings(gateway="sglang_router", **settings))  # type: ignore[arg-type]

    assert problems(policy="bucket") == [
        f"policy: 'bucket' is only valid as prefill_policy; valid here: {valid}"
    ]
    assert problems(policy="prefix_hash") == [
        f"policy: unknown policy 'prefix_hash'; valid: {valid} ('prefix_hash' exists in sglang-router 0.3.2 "
        "but answers 503 no_available_workers in HTTP mode; SMG serves it: gateway=smg)"
    ]
    assert problems(policy="least_load") == [
        f"policy: unknown policy 'least_load'; valid: {valid} ('least_load' is an SMG policy: gateway=smg)"
    ]
    assert problems(policy="zzz") == [f"policy: unknown policy 'zzz'; valid: {valid}"]
    # "random_robin" is half random, half round_robin: both are offered, joined by "or"
    (msg,) = problems(policy="random_robin")
    match = re.fullmatch(
        rf"policy: unknown policy 'random_robin'; valid: {valid} \(did you mean (\w+) or (\w+)\?\)", msg
    )
    assert match, msg
    assert set(match.groups()) == {"round_robin", "random"}


def test_log_level_hint_only_for_warning() -> None:
    assert validate_router_settings(RouterSettings(log_level="trace")) == [
        "log_level: 'trace' is not one of debug, info, warn, error"
    ]
    assert validate_router_settings(RouterSettings(log_level="WARNING")) == [
        "log_level: 'WARNING' is not one of debug, info, warn, error (did you mean 'warn'?)"
    ]


# RouterArgs fields (sglang-router 0.3.2) of each annotation, a value of the right type and one of the wrong type.
_EXTRA_TYPES = [
    ("balance_abs_threshold", "int", 10, "10"),
    ("max_tree_size", "int", 2**20, True),
    ("cache_threshold", "float", 0.5, True),
    ("balance_rel_threshold", "float", 2, "2"),
    ("health_check_endpoint", "str", "/health", 5),
    ("dp_aware", "bool", True, 1),
    ("rate_limit_tokens_per_second", "Optional[int]", None, "fast"),
    ("rate_limit_tokens_per_second", "Optional[int]", 100, 1.5),
    ("request_id_headers", "Optional[List[str]]", ["x-request-id"], "x-request-id"),
    ("prometheus_duration_buckets", "Optional[List[float]]", (0.1, 1.0), 0.1),
    ("cors_allowed_origins", "List[str]", ["http://a"], "http://a"),
    ("selector", "Dict[str, str]", {"app": "sglang"}, ["app"]),
]


@pytest.mark.parametrize(("key", "type_name", "good", "bad"), _EXTRA_TYPES)
def test_extra_values_are_checked_against_router_args_types(
    key: str, type_name: str, good: object, bad: object
) -> None:
    assert validate_router_settings(RouterSettings(gateway="sglang_router", extra={key: good})) == []
    assert validate_router_settings(RouterSettings(gateway="sglang_router", extra={key: bad})) == [
        f"extra.{key}: expected {type_name}, got {bad!r}"
    ]


# The same fields in SMG 1.13.0, whose RouterArgs are annotated PEP 604 style (``int | None``, ``list[str]``),
# plus fields of its own.
_SMG_EXTRA_TYPES = [
    ("balance_abs_threshold", "int", 10, "10"),
    ("cache_threshold", "float", 0.5, True),
    ("dp_aware", "bool", True, 1),
    ("rate_limit_tokens_per_second", "int | None", None, "fast"),
    ("rate_limit_tokens_per_second", "int | None", 100, 1.5),
    ("request_id_headers", "list[str] | None", ["x-request-id"], "x-request-id"),
    ("prometheus_duration_buckets", "list[float] | None", (0.1, 1.0), 0.1),
    ("cors_allowed_origins", "list[str]", ["http://a"], "http://a"),
    ("selector", "dict[str, str]", {"app": "sglang"}, ["app"]),
    ("remove_unhealthy_workers", "bool | None", False, "no"),
    ("worker_overload_token_usage", "float | None", 0.8, "high"),
    ("enable_rl", "bool", True, "yes"),
]


@pytest.mark.skipif(not gateway_installed("smg"), reason="SMG is not installed (the [smg] extra)")
@pytest.mark.parametrize(("key", "type_name", "good", "bad"), _SMG_EXTRA_TYPES)
def test_extra_values_are_checked_against_smg_router_args_types(
    key: str, type_name: str, good: object, bad: object
) -> None:
    assert validate_router_settings(RouterSettings(gateway="smg", extra={key: good})) == []
    assert validate_router_settings(RouterSettings(gateway="smg", extra={key: bad})) == [
        f"extra.{key}: expected {type_name}, got {bad!r}"
    ]


def test_extra_values_must_be_json() -> None:
    # a list (the right type) holding a set, which JSON cannot carry to the router's process
    assert validate_router_settings(RouterSettings(extra={"cors_allowed_origins": [{"a"}]})) == [
        "extra.cors_allowed_origins: value [{'a'}] is not JSON-serialisable"
    ]


def test_extra_key_suggestions() -> None:
    assert validate_router_settings(RouterSettings(gateway="sglang_router", extra={"zzzz": 1})) == [
        "extra.zzzz: not a sglang-router RouterArgs field"
    ]
    # many RouterArgs fields end in _threshold: three are offered, joined by ", "
    (msg,) = validate_router_settings(RouterSettings(gateway="sglang_router", extra={"balance_threshold": 1}))
    match = re.fullmatch(
        r"extra\.balance_threshold: not a sglang-router RouterArgs field; did you mean (\w+), (\w+), (\w+)\?",
        msg,
    )
    assert match, msg
    from miles_sglang_plugin.rendering.router_specs import router_args_fields

    assert len(set(match.groups())) == 3 and all(name.endswith("_threshold") for name in match.groups())
    assert set(match.groups()) <= set(router_args_fields())


def test_extra_without_sglang_router_is_one_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_sglang_plugin.rendering import router_specs

    router_specs.router_args_fields.cache_clear()
    monkeypatch.setitem(sys.modules, "sglang_router.router_args", None)  # import fails as if not installed
    try:
        problems = validate_router_settings(
            RouterSettings(gateway="sglang_router", extra={"balance_abs_threshold": 10, "host": "h"})
        )
    finally:
        router_specs.router_args_fields.cache_clear()
    assert len(problems) == 2, problems
    assert problems[0].startswith(
        "extra: cannot check keys against RouterArgs (sglang_router import failed: "
    )
    # what needs no RouterArgs is still checked
    assert problems[1] == "extra.host: not allowed here: set by the launch spec"
    assert validate_router_settings(RouterSettings()) == []


def _installed_gateways() -> list[str]:
    return [name for name in GATEWAYS if gateway_installed(name)]


@pytest.mark.parametrize("gateway", _installed_gateways())
def test_router_args_kwargs_build_real_router_args(gateway: str) -> None:
    RouterArgs = importlib.import_module(f"{gateway_info(gateway).module}.router_args").RouterArgs

    spec = _spec(
        host="127.0.0.2",
        pd_disaggregation=True,
        api_key=SECRET,
        settings=RouterSettings(
            gateway=gateway, policy="consistent_hashing", extra={"balance_abs_threshold": 10}
        ),
    )
    kwargs = router_main.build_router_args_kwargs(spec)
    assert "gateway" not in kwargs  # which RouterArgs, not one of its fields
    assert "drain_settle_secs" not in kwargs  # SMG's Rust router takes it, not its RouterArgs
    args = RouterArgs(**kwargs)
    assert (args.host, args.port, args.prometheus_host, args.prometheus_port) == (
        "127.0.0.2",
        30100,
        "127.0.0.2",
        30101,
    )
    assert args.policy == "consistent_hashing" and args.pd_disaggregation is True
    assert args.worker_urls == [] and args.prefill_urls == [] and args.decode_urls == []
    assert args.api_key == SECRET and args.balance_abs_threshold == 10
    assert args.request_timeout_secs == 14400 and args.log_level == "warn"
    # Stopped with its engines: no wait for requests that cannot finish (RouterArgs' 180; SMG's ~5 s anyway).
    assert args.shutdown_grace_period_secs == 0


def test_router_main_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(settings=RouterSettings(policy="bucket"))
    assert router_main.main(["--spec-json", spec.to_json()]) == 2
    assert "only valid as prefill_policy" in capsys.readouterr().err


def test_router_main_needs_key_when_spec_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert router_main.main(["--spec-json", _spec(api_key=SECRET).to_json()]) == 2
    assert API_KEY_ENV in capsys.readouterr().err
    assert router_main.main(["--spec-json", "{not json"]) == 2


def _register(router_url: str, *workers: WorkerRegistration, api_key: str | None = None) -> list[str | None]:
    """``router_client.register`` of every worker at once, reading the router through shared reads as the
    reconciler does; ``api_key`` is the router's (in the pool's headers) and the workers' (in each POST), as
    a deployment's one key is. Each registration's problem, or None."""

    async def step(pool: ClientPool) -> list[str | None]:
        reads = SharedReads(pool, asyncio.ensure_future)
        return list(await asyncio.gather(*(register(reads, router_url, w, api_key) for w in workers)))

    return on_router(step, api_key)


def _listed(
    router_url: str, expected: list[WorkerRegistration], api_key: str | None = None
) -> tuple[bool, str]:
    return on_router(lambda pool: listed(pool, router_url, expected), api_key)


def _deregister(router_url: str, url: str) -> str | None:
    return on_router(lambda pool: deregister(pool, router_url, url))


def _urls(router_url: str) -> list[str]:
    return sorted(str(w["url"]) for w in router_workers(router_url))


def _urls_become(router_url: str, urls: list[str], timeout_s: float = 30.0) -> list[str]:
    """The router's listed URLs, read until they are ``urls`` (a removal is queued) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while (seen := _urls(router_url)) != sorted(urls) and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_the_client_reports_an_unreachable_router() -> None:
    port = _free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    worker = WorkerRegistration("http://127.0.0.1:1")
    ok, detail = _listed(url, [worker])
    assert not ok and detail.startswith(f"GET {url}/workers: ConnectError: "), detail
    (problem,) = _register(url, worker)  # refused at once: no wait for the registration deadline
    assert problem is not None and problem.startswith(f"POST {url}/workers: ConnectError: "), problem
    problem = _deregister(url, worker.url)
    assert problem is not None and problem.startswith(f"GET {url}/workers: ConnectError: "), problem


# ==========================================================================================================
# Integration: real sglang-router + stand-in engines
# ==========================================================================================================


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str = ""
    argv: list[str] = field(default_factory=list)

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""


_ALL_PROCS: list[Proc] = []


def _stop(proc: Proc, grace_s: float = 5.0) -> int | None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; always reap. Returns the exit code."""
    p = proc.popen
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    # anything else left in the group (there should be nothing)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    return p.returncode


class Launcher:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def _popen(self, name: str, argv: list[str], env_extra: dict[str, str]) -> Proc:
        log = self.tmp / f"{name}.log"
        env = {**os.environ, **env_extra}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log, argv=argv)
        self.procs.append(proc)
        _ALL_PROCS.append(proc)
        return proc

    def _wait_http(self, proc: Proc, path: str, timeout_s: float = 30.0) -> float:
        t0 = time.monotonic()
        while True:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(proc.url + path, timeout=1).status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{proc.name} not answering {path} after {timeout_s}s:\n{proc.tail()}")
            time.sleep(0.02)

    def engine(
        self,
        mode: str = "null",
        bootstrap_port: int | None = None,
        api_key: str | None = None,
        port: int | None = None,
        dp_size: int = 1,
    ) -> Proc:
        (port,) = [port] if port is not None else _free_ports(1)
        argv = [sys.executable, "-m", "miles_sglang_plugin.standin", "--model-path", "msp-router-test-model"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if mode != "null":
            argv += ["--disaggregation-mode", mode]
        if bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if api_key:
            argv += ["--api-key", api_key]
        if dp_size > 1:
            argv += ["--dp-size", str(dp_size), "--tp-size", str(dp_size), "--enable-dp-attention"]
        proc = self._popen(f"engine-{mode}-{port}-{len(self.procs)}", argv, {})
        proc.url = f"http://127.0.0.1:{port}"
        self._wait_http(proc, "/health")
        return proc

    def router(self, spec: RouterLaunchSpec) -> tuple[Proc, float]:
        argv, env = router_command(spec)
        proc = self._popen(f"router-{spec.model}-{spec.port}", argv, env)
        proc.url = spec.url
        return proc, self._wait_http(proc, "/liveness")

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    la = Launcher(tmp_path)
    try:
        yield la
    finally:
        la.close()


def _router_spec(model: str, pd: bool = False, api_key: str | None = None, **settings) -> RouterLaunchSpec:
    port, prom = _free_ports(2)
    settings.setdefault("log_level", "warn")
    return RouterLaunchSpec(
        model=model,
        host="127.0.0.1",
        port=port,
        prometheus_port=prom,
        pd_disaggregation=pd,
        settings=RouterSettings(**settings),
        api_key=api_key,
    )


def _generate(url: str, headers: dict[str, str] | None = None, text: str = "hello world") -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4}}
    return httpx.post(url, json=body, headers=headers or {}, timeout=30)


def test_regular_round_robin(launcher: Launcher) -> None:
    e1, e2 = launcher.engine(), launcher.engine()
    spec = _router_spec("actor", policy="round_robin", disable_circuit_breaker=True)
    t0 = time.monotonic()
    router, live_s = launcher.router(spec)
    workers = [WorkerRegistration(e1.url), WorkerRegistration(e2.url + "/")]  # trailing '/' is normalised
    assert _listed(spec.url, workers) == (
        False,
        f"waiting for 2 of 2 workers: {e1.url} (regular) not registered yet; "
        f"{e2.url} (regular) not registered yet",
    )
    assert _register(spec.url, *workers) == [None, None]  # each returns once the router lists it healthy
    ready_s = time.monotonic() - t0
    print(f"\nrouter /liveness after {live_s:.2f}s, ready (2 workers) {ready_s:.2f}s after Popen")
    assert _listed(spec.url, workers) == (True, "ready: 2 workers healthy")

    listed = router_workers(spec.url)
    assert sorted(w["url"] for w in listed) == sorted([e1.url, e2.url])
    assert all(w["worker_type"] == "regular" and w["is_healthy"] is True for w in listed)

    registry = RouterRegistry([ModelRoute.from_launch_spec(spec)])
    url = registry.get_model_url("actor")
    assert registry.routing_headers("actor", "ignored") == {}
    ports = []
    for _ in range(4):
        r = _generate(url)
        assert r.status_code == 200, r.text
        ports.append(r.json()["meta_info"]["stand_in"]["port"])
    assert sorted(set(ports)) == sorted(int(e.url.rsplit(":", 1)[1]) for e in (e1, e2))
    assert ports[0] != ports[1]  # round robin alternates

    # a type mismatch is reported, not hidden, and the workers not asked about are named
    assert _listed(spec.url, [WorkerRegistration(e1.url, "decode")]) == (
        False,
        f"waiting for 1 of 1 workers: {e1.url} registered as 'regular', expected 'decode'; "
        f"also registered: {e2.url}",
    )

    # the start line names model, url, policy and pd
    assert f"router for model 'actor' at {spec.url} policy=round_robin pd=False" in router.tail()

    # SIGTERM: graceful shutdown, exit code 0
    t = time.monotonic()
    os.killpg(router.popen.pid, signal.SIGTERM)
    assert router.popen.wait(10) == 0, router.tail()
    print(f"router exited {time.monotonic() - t:.3f}s after SIGTERM")
    assert "stopped" in router.tail()


def test_pd_mode_passes_bootstrap_fields(launcher: Launcher) -> None:
    (bootstrap,) = _free_ports(1)
    prefill = launcher.engine("prefill", bootstrap_port=bootstrap)
    decode = launcher.engine("decode")
    spec = _router_spec(
        "actor", pd=True, policy="round_robin", disable_circuit_breaker=True, disable_retries=True
    )
    router, _ = launcher.router(spec)
    workers = [
        WorkerRegistration(prefill.url, "prefill", bootstrap),
        WorkerRegistration(decode.url, "decode"),
    ]

    async def prefill_first(pool: ClientPool) -> dict[str, object]:
        """The prefill worker registered alone: listed healthy, yet its registration waits for /readiness,
        which in PD mode wants a decode worker too; the decode worker's registration completes both."""
        reads = SharedReads(pool, asyncio.ensure_future)
        prefill_in = asyncio.ensure_future(register(reads, spec.url, workers[0], None))
        async with asyncio.timeout(30):
            while True:
                entries, _ = await workers_of(pool, spec.url)
                if any(w.get("is_healthy") for w in entries or []):
                    break
                await asyncio.sleep(0.02)
        seen = {
            "prefill alone": await listed(pool, spec.url, workers[:1]),
            "both": await listed(pool, spec.url, workers),
            "prefill's registration done": prefill_in.done(),
        }
        seen["decode's registration"] = await register(reads, spec.url, workers[1], None)
        seen["prefill's registration"] = await prefill_in
        seen["both, after"] = await listed(pool, spec.url, workers)
        return seen

    seen = on_router(prefill_first)
    # PD mode's /readiness (both gateways): 503 until a prefill and a decode worker are healthy
    not_ready = '{"status": "not ready", "reason": "insufficient healthy workers"}'
    assert seen == {
        "prefill alone": (False, f"all 1 expected workers registered, but /readiness: HTTP 503: {not_ready}"),
        "both": (False, f"waiting for 1 of 2 workers: {decode.url} (decode) not registered yet"),
        "prefill's registration done": False,
        "decode's registration": None,
        "prefill's registration": None,
        "both, after": (True, "ready: 2 workers healthy"),
    }
    by_type = {w["worker_type"]: w for w in router_workers(spec.url)}
    assert by_type["prefill"]["bootstrap_port"] == bootstrap and "bootstrap_port" not in by_type["decode"]

    # the stand-in rejects PD requests without bootstrap fields: the router must add them
    assert _generate(decode.url + "/generate").status_code == 400
    r = _generate(spec.url + "/generate")
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]["stand_in"]
    assert meta["port"] == int(decode.url.rsplit(":", 1)[1])  # the client gets the decode answer
    assert meta["disaggregation_mode"] == "decode"
    assert meta["bootstrap_host"] == "127.0.0.1"
    assert meta["bootstrap_port"] == bootstrap
    assert isinstance(meta["bootstrap_room"], int) and 0 <= meta["bootstrap_room"] < 2**63
    assert "pd=True" in router.tail()


def test_consistent_hashing_pins_routing_key(launcher: Launcher) -> None:
    engines = [launcher.engine(), launcher.engine()]
    spec = _router_spec("actor", policy="consistent_hashing", disable_circuit_breaker=True)
    router, _ = launcher.router(spec)
    workers = [WorkerRegistration(e.url) for e in engines]
    assert _register(spec.url, *workers) == [None, None]

    registry = RouterRegistry.from_env(RouterRegistry([ModelRoute.from_launch_spec(spec)]).to_env())
    with pytest.raises(ValueError, match="needs a routing key"):
        registry.routing_headers("actor", None)
    used = set()
    for key in ("sample-0", "sample-1", "sample-2", "sample-3", "sample-4"):
        headers = registry.routing_headers("actor", key)
        ports = {_generate(registry.get_model_url("actor"), headers).json()["meta_info"]["stand_in"]["port"]}
        for _ in range(9):
            r = _generate(registry.get_model_url("actor"), headers, text=f"other prompt {len(ports)}")
            assert r.status_code == 200, r.text
            ports.add(r.json()["meta_info"]["stand_in"]["port"])
        assert len(ports) == 1, f"key {key} went to {ports}"
        used |= ports
    print(f"\n5 keys used workers {sorted(used)}")
    assert "policy=consistent_hashing" in router.tail()


def test_api_key(launcher: Launcher) -> None:
    engine = launcher.engine(api_key=SECRET)
    spec = _router_spec("actor", api_key=SECRET, policy="round_robin")
    router, _ = launcher.router(spec)
    # not in the router's argv (what `ps` shows)
    cmdline = Path(f"/proc/{router.popen.pid}/cmdline").read_bytes()
    assert SECRET.encode() not in cmdline

    workers = [WorkerRegistration(engine.url)]
    (problem,) = _register(spec.url, *workers)  # no key: refused at once
    assert problem is not None and problem.startswith(f"POST {spec.url}/workers: HTTP 401"), problem
    ok, detail = _listed(spec.url, workers)
    assert not ok and detail.startswith(f"GET {spec.url}/workers: HTTP 401"), detail

    assert _register(spec.url, *workers, api_key=SECRET) == [None]  # the router's key, also the worker's
    assert _listed(spec.url, workers, api_key=SECRET) == (True, "ready: 1 workers healthy")

    assert _generate(spec.url + "/generate").status_code == 401
    assert _generate(spec.url + "/generate", {"Authorization": "Bearer wrong"}).status_code == 401
    r = _generate(spec.url + "/generate", {"Authorization": f"Bearer {SECRET}"})
    assert r.status_code == 200, r.text
    assert SECRET not in router.tail()


def test_deregister_workers(launcher: Launcher) -> None:
    engines = [launcher.engine(), launcher.engine()]
    first, second = sorted(e.url for e in engines)
    spec = _router_spec("critic", policy="random")
    launcher.router(spec)
    workers = [WorkerRegistration(first), WorkerRegistration(second)]
    assert _register(spec.url, *workers) == [None, None]
    assert _urls(spec.url) == [first, second]

    assert _deregister(spec.url, first) is None
    assert _urls_become(spec.url, [second]) == [second]  # the removal is queued (202)
    assert _listed(spec.url, workers) == (
        False,
        f"waiting for 1 of 2 workers: {first} (regular) not registered yet",
    )
    assert _listed(spec.url, workers[1:]) == (True, "ready: 1 workers healthy")

    assert _deregister(spec.url, second) is None
    assert _urls_become(spec.url, []) == []
    assert _listed(spec.url, workers) == (
        False,
        f"waiting for 2 of 2 workers: {first} (regular) not registered yet; {second} (regular) not registered yet",
    )
    assert httpx.get(spec.url + "/readiness", timeout=10).status_code == 503
    # nothing expected: listed as it should be, /readiness not asked (a router with no engine to serve)
    assert _listed(spec.url, []) == (True, "ready: 0 workers healthy")
    assert _deregister(spec.url, first) is None  # not listed: nothing to take out


def test_router_main_port_in_use(launcher: Launcher) -> None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        (prom,) = _free_ports(1)
        spec = RouterLaunchSpec("actor", "127.0.0.1", port, prom, False, RouterSettings())
        argv, env = router_command(spec)
        proc = launcher._popen("router-port-in-use", argv, env)
        assert proc.popen.wait(30) == 1, proc.tail()
        assert f"on {spec.url} (metrics port {prom}) failed" in proc.tail()
        assert "Address already in use" in proc.tail()
    finally:
        holder.close()


def _labels_listed(entry: dict, gateway: str) -> dict[str, str]:
    """The labels a router lists for a worker: SMG under ``labels``, sglang-router 0.3.2 in ``metadata``."""
    return entry["labels"] if gateway == "smg" else entry["metadata"]


def test_a_registered_url_registered_again(launcher: Launcher, test_gateway: str) -> None:
    engine = launcher.engine()
    spec = _router_spec("actor", policy="round_robin")
    launcher.router(spec)
    first = WorkerRegistration(engine.url, labels={"engine_id": "actor.regular.0", "restarts": "0"})
    assert _register(spec.url, first) == [None]

    # A second POST of the URL: SMG refuses it, sglang-router 0.3.2 accepts it and keeps the old entry.
    again = WorkerRegistration(engine.url, labels={"engine_id": "actor.regular.0", "restarts": "1"})
    raw = httpx.post(spec.url + "/workers", json=again.payload(), timeout=10)
    if test_gateway == "smg":
        assert raw.status_code == 409 and raw.json()["code"] == "WORKER_ALREADY_EXISTS", raw.text
    else:
        assert raw.status_code == 202 and raw.json()["status"] == "accepted", raw.text
        time.sleep(0.5)  # its job runs (and fails) in the background
    (entry,) = router_workers(spec.url)
    assert _labels_listed(entry, test_gateway)["restarts"] == "0"

    # register answers SMG's 409 by taking the listed entry out and posting again; sglang-router keeps its
    # entry (the same URL, type and bootstrap port: the plan's labels of an engine do not change)
    assert _register(spec.url, again) == [None]
    if test_gateway == "sglang_router":
        time.sleep(0.5)
    (entry,) = router_workers(spec.url)
    assert _labels_listed(entry, test_gateway)["restarts"] == ("1" if test_gateway == "smg" else "0")

    # out of the router, then registered: one entry, the new registration's, with either gateway
    newer = WorkerRegistration(engine.url, labels={"engine_id": "actor.regular.0", "restarts": "2"})
    assert _deregister(spec.url, engine.url) is None
    assert _urls_become(spec.url, []) == []
    assert _register(spec.url, newer) == [None]
    (entry,) = router_workers(spec.url)
    assert _labels_listed(entry, test_gateway)["restarts"] == "2"
    assert (entry["url"], entry["worker_type"], entry["is_healthy"]) == (engine.url, "regular", True)


def test_an_engine_restarted_on_its_url_serves_again(launcher: Launcher) -> None:
    """What supervision does with a lost engine: take it out, start it again on its port, register it."""
    engine, other = launcher.engine(), launcher.engine()
    spec = _router_spec("actor", policy="round_robin", disable_circuit_breaker=True)
    launcher.router(spec)
    workers = [WorkerRegistration(engine.url), WorkerRegistration(other.url)]
    assert _register(spec.url, *workers) == [None, None]

    port = int(engine.url.rsplit(":", 1)[1])
    _stop(engine)
    assert _deregister(spec.url, engine.url) is None
    assert _urls_become(spec.url, [other.url]) == [other.url]
    restarted = launcher.engine(port=port)
    assert _register(spec.url, workers[0]) == [None]
    assert _listed(spec.url, workers) == (True, "ready: 2 workers healthy")
    ports = {_generate(spec.url + "/generate").json()["meta_info"]["stand_in"]["port"] for _ in range(4)}
    assert ports == {port, int(other.url.rsplit(":", 1)[1])}
    assert restarted.popen.poll() is None


def test_registration_labels_are_listed(launcher: Launcher, test_gateway: str) -> None:
    engine = launcher.engine()
    spec = _router_spec("actor", policy="round_robin")
    launcher.router(spec)
    worker = WorkerRegistration(
        engine.url,
        labels={
            "model": "actor",
            "group": "regular",
            "worker_type": "regular",
            "engine_id": "actor.regular.0",
            "needs_offload": "true",
            "update_weights": "true",
        },
    )
    assert _register(spec.url, worker) == [None]
    (entry,) = router_workers(spec.url)
    shown = _labels_listed(entry, test_gateway)
    assert {key: shown[key] for key in worker.label_map} == {
        "model": "actor",
        "group": "regular",
        "worker_type": "regular",
        "engine_id": "actor.regular.0",
        "needs_offload": "true",
        "update_weights": "true",
    }


@pytest.mark.skipif(not gateway_installed("smg"), reason="SMG is not installed (the [smg] extra)")
def test_smg_rl_workers_show_the_labels_and_select_by_them(launcher: Launcher) -> None:
    engines = [launcher.engine(), launcher.engine()]
    spec = _router_spec("actor", gateway="smg", policy="round_robin", extra={"enable_rl": True})
    launcher.router(spec)
    workers = [
        WorkerRegistration(e.url, labels={"model": "actor", "group": group, "engine_id": f"actor.{group}.0"})
        for e, group in zip(engines, ("regular", "small"), strict=True)
    ]
    assert _register(spec.url, *workers) == [None, None]
    shown = httpx.get(spec.url + "/v1/rl/workers", timeout=10).json()["workers"]
    assert sorted((w["url"], w["labels"]["group"], w["labels"]["engine_id"]) for w in shown) == sorted(
        [(engines[0].url, "regular", "actor.regular.0"), (engines[1].url, "small", "actor.small.0")]
    )
    # a fan-out by label reaches exactly the engines it selects
    r = httpx.post(
        spec.url + "/v1/rl/engine/flush_cache", params={"selector": "group=small"}, json={}, timeout=10
    )
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["total"] == 1 and result["succeeded"] == 1, result
    assert [call["url"] for call in result["results"].values()] == [engines[1].url]


@pytest.mark.skipif(not gateway_installed("smg"), reason="SMG is not installed (the [smg] extra)")
def test_smg_keeps_a_removed_worker_draining_for_its_drain_settle_time(launcher: Launcher) -> None:
    """SMG's Rust router keeps a removed worker listed (a new POST of its URL refused) for drain_settle_secs
    (SMG's default 5); the routers here set it from sglang_deploy.router.drain_settle_secs (default 0)."""
    engine = launcher.engine()
    for drain in (30, 0):
        spec = _router_spec("actor", gateway="smg", policy="round_robin", drain_settle_secs=drain)
        router, _ = launcher.router(spec)
        worker = WorkerRegistration(engine.url)
        assert _register(spec.url, worker) == [None]
        assert _deregister(spec.url, engine.url) is None
        if drain:
            time.sleep(1.0)  # well within its 30 s
            assert _urls(spec.url) == [engine.url]
            raw = httpx.post(spec.url + "/workers", json=worker.payload(), timeout=10)
            assert raw.status_code == 409 and raw.json()["code"] == "WORKER_ALREADY_EXISTS"
        else:
            assert _urls_become(spec.url, []) == []
            assert httpx.post(spec.url + "/workers", json=worker.payload(), timeout=10).status_code == 202
        _stop(router)


def test_dp_aware_router_lists_each_rank(launcher: Launcher, test_gateway: str) -> None:
    """Miles' dp-aware router (DP attention): an engine of dp_size 2 is listed once per rank, and counts as
    registered; only SMG can take it out again (sglang-router 0.3.2's removal looks for ``url@0@``)."""
    engine = launcher.engine(dp_size=2)
    spec = _router_spec("actor", policy="round_robin", extra={"dp_aware": True})
    launcher.router(spec)
    worker = WorkerRegistration(engine.url)
    assert _register(spec.url, worker) == [None]  # both ranks' entries listed healthy
    ranks = [engine.url + "@0", engine.url + "@1"]
    assert _urls(spec.url) == ranks
    assert _listed(spec.url, [worker]) == (True, "ready: 1 workers healthy")
    assert _generate(spec.url + "/generate").status_code == 200
    assert _deregister(spec.url, engine.url) is None  # a DELETE of each rank's entry, each answered 202
    if test_gateway == "smg":
        assert _urls_become(spec.url, []) == []
    else:
        time.sleep(1.0)
        assert _urls(spec.url) == ranks  # 0.3.2 keeps them (its removal job fails)


def test_nothing_left_running() -> None:
    """Runs last in this file: every process these tests started has been reaped."""
    alive = [p.name for p in _ALL_PROCS if p.popen.poll() is None]
    assert alive == []
    for p in _ALL_PROCS:
        with pytest.raises(ProcessLookupError, match="No such process"):
            os.killpg(p.popen.pid, 0)
