"""RouterRegistry / ModelRoute / get_model_url: strict name lookup, URLs, routing headers, hand-off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_sglang_plugin.addresses import http_base_url
from miles_sglang_plugin.rendering.router_specs import ROUTER_POLICIES
from miles_sglang_plugin.serving.registry import (
    ENV_VAR,
    ROUTING_KEY_HEADER,
    ModelRoute,
    RouterRegistry,
    UnknownModelError,
    get_model_url,
)


@pytest.fixture
def registry() -> RouterRegistry:
    return RouterRegistry(
        [
            ModelRoute("actor", "10.0.0.1", 3001, "consistent_hashing", False),
            ModelRoute("critic", "10.0.0.2", 3002, "round_robin", False),
            ModelRoute("reward-model", "::1", 3003, "cache_aware", True),
            ModelRoute("session", "10.0.0.3", 3004, "manual", False),
        ]
    )


# -- unknown names -----------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names_sorted(registry: RouterRegistry) -> None:
    with pytest.raises(UnknownModelError) as info:
        registry.get_model_url("policy")
    msg = str(info.value)
    assert "'policy'" in msg
    assert "known models: actor, critic, reward-model, session" in msg
    assert isinstance(info.value, KeyError)
    assert info.value.known == ("actor", "critic", "reward-model", "session")


def test_unknown_name_suggests_close_match(registry: RouterRegistry) -> None:
    with pytest.raises(UnknownModelError, match=r"Did you mean 'actor'\?"):
        registry.get_model_url("acter")
    with pytest.raises(UnknownModelError, match=r"Did you mean 'reward-model'\?"):
        registry["reward_model"]


def test_unknown_name_in_empty_registry() -> None:
    with pytest.raises(UnknownModelError, match="no routers are registered"):
        RouterRegistry().get_model_url("actor")


def test_keyerror_str_is_not_quoted(registry: RouterRegistry) -> None:
    with pytest.raises(KeyError) as info:
        registry["nope"]
    assert not str(info.value).startswith('"')


# -- URLs ----------------------------------------------------------------------------------------------------


def test_endpoint_joining(registry: RouterRegistry) -> None:
    assert registry.get_model_url("critic") == "http://10.0.0.2:3002/generate"
    assert (
        registry.get_model_url("critic", "/v1/chat/completions") == "http://10.0.0.2:3002/v1/chat/completions"
    )
    assert registry.get_model_url("critic", "/") == "http://10.0.0.2:3002/"
    assert registry["critic"].base_url == "http://10.0.0.2:3002"


@pytest.mark.parametrize("endpoint", ["generate", "", "v1/models", None])
def test_endpoint_must_start_with_slash(registry: RouterRegistry, endpoint: object) -> None:
    with pytest.raises(ValueError, match="must start with '/'"):
        registry.get_model_url("critic", endpoint)  # type: ignore[arg-type]


def test_ipv6_hosts_are_bracketed(registry: RouterRegistry) -> None:
    assert registry.get_model_url("reward-model") == "http://[::1]:3003/generate"
    # a host given already bracketed (as Miles stores it) is not double-wrapped
    route = ModelRoute("m", "[fe80::1]", 8000)
    assert route.host == "fe80::1"
    assert route.base_url == "http://[fe80::1]:8000"
    assert http_base_url("2001:db8::5", 1) == "http://[2001:db8::5]:1"
    assert http_base_url("localhost", 2) == "http://localhost:2"


# -- routing headers -----------------------------------------------------------------------------------------


def test_routing_headers_per_policy(registry: RouterRegistry) -> None:
    assert registry.routing_headers("actor", "k1") == {ROUTING_KEY_HEADER: "k1"}
    assert registry.routing_headers("session", "s-9") == {"X-SMG-Routing-Key": "s-9"}
    # other policies: no header, a given key is ignored
    assert registry.routing_headers("critic", "k1") == {}
    assert registry.routing_headers("critic", None) == {}
    assert registry.routing_headers("reward-model", "") == {}


@pytest.mark.parametrize("model", ["actor", "session"])
@pytest.mark.parametrize("key", [None, ""])
def test_routing_key_required_for_key_policies(registry: RouterRegistry, model: str, key: str | None) -> None:
    with pytest.raises(ValueError, match="needs a routing key"):
        registry.routing_headers(model, key)


def test_routing_headers_unknown_model(registry: RouterRegistry) -> None:
    with pytest.raises(
        UnknownModelError, match=r"no router for model 'acter'; known models: .*Did you mean 'actor'"
    ):
        registry.routing_headers("acter", "k")


# -- Miles / slime args namespace -----------------------------------------------------------------------------


def test_miles_args_namespace() -> None:
    args = SimpleNamespace(
        sglang_model_routers={"actor": ("10.1.1.1", 4000), "ref": ["[::1]", "4001"]},
        sglang_router_ip="10.9.9.9",
        sglang_router_port=9999,
    )
    assert get_model_url(args, "actor") == "http://10.1.1.1:4000/generate"
    assert get_model_url(args, "ref", "/v1/completions") == "http://[::1]:4001/v1/completions"
    # strict: no fall-back to sglang_router_ip/port
    with pytest.raises(UnknownModelError, match="known models: actor, ref"):
        get_model_url(args, "critic")


def test_miles_args_policy_is_picked_up() -> None:
    args = SimpleNamespace(
        sglang_model_routers={"actor": ("h", 1)}, sglang_router_policy="consistent_hashing"
    )
    reg = RouterRegistry.from_miles_args(args)
    assert reg["actor"].policy == "consistent_hashing"
    with pytest.raises(ValueError, match="policy 'consistent_hashing', which needs a routing key"):
        reg.routing_headers("actor", None)
    slime_args = SimpleNamespace(sglang_model_routers={"actor": ("h", 1)}, router_policy="round_robin")
    assert RouterRegistry.from_miles_args(slime_args)["actor"].policy == "round_robin"


def test_miles_args_without_router_map() -> None:
    args = SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=3000)
    with pytest.raises(ValueError, match="sglang_model_routers"):
        get_model_url(args, "actor")
    with pytest.raises(ValueError, match=r"\(host, port\)"):
        get_model_url(SimpleNamespace(sglang_model_routers={"a": ("h", 1, 2)}), "a")


def test_get_model_url_accepts_registry(registry: RouterRegistry) -> None:
    assert get_model_url(registry, "actor", "/health") == "http://10.0.0.1:3001/health"


# -- mapping behaviour and validation ------------------------------------------------------------------------


def test_mapping_protocol(registry: RouterRegistry) -> None:
    assert "actor" in registry
    assert "nope" not in registry
    assert 3 not in registry
    assert list(registry) == ["actor", "critic", "reward-model", "session"]
    assert registry.names() == ("actor", "critic", "reward-model", "session")
    assert len(registry) == 4
    assert registry.get("nope") is None  # Mapping.get catches the KeyError subclass
    assert dict(registry)["critic"].port == 3002


def test_registry_is_immutable(registry: RouterRegistry) -> None:
    with pytest.raises(TypeError, match="does not support item assignment"):
        registry["x"] = ModelRoute("x", "h", 1)  # type: ignore[index]
    with pytest.raises(AttributeError, match="object has no attribute 'foo'"):
        registry.foo = 1  # type: ignore[attr-defined]


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        RouterRegistry([ModelRoute("a", "h", 1), ModelRoute("a", "h", 2)])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "", "host": "h", "port": 1}, "name"),
        ({"name": "a", "host": "", "port": 1}, "host"),
        ({"name": "a", "host": "h", "port": 0}, "port"),
        ({"name": "a", "host": "h", "port": 70000}, "port"),
        ({"name": "a", "host": "h", "port": True}, "port"),
        ({"name": "a", "host": "h", "port": 1, "policy": "bucket"}, "policy"),
        ({"name": "a", "host": "h", "port": 1, "policy": "round-robin"}, "valid: cache_aware"),
    ],
)
def test_model_route_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelRoute(**kwargs)


# -- serialisation and env hand-off ---------------------------------------------------------------------------


def test_json_round_trip(registry: RouterRegistry) -> None:
    again = RouterRegistry.from_json(registry.to_json())
    assert dict(again) == dict(registry)
    assert json.loads(registry.to_json())["version"] == 1


def test_env_round_trip(registry: RouterRegistry) -> None:
    env = registry.to_env()
    assert set(env) == {ENV_VAR} and ENV_VAR == "MSP_ROUTERS"
    again = RouterRegistry.from_env(env)
    assert dict(again) == dict(registry)
    assert again.get_model_url("reward-model") == "http://[::1]:3003/generate"


def test_env_round_trip_through_os_environ(registry: RouterRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in registry.to_env().items():
        monkeypatch.setenv(k, v)
    assert dict(RouterRegistry.from_env()) == dict(registry)


def test_from_env_missing_variable() -> None:
    with pytest.raises(LookupError, match="MSP_ROUTERS is not set"):
        RouterRegistry.from_env({})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "router registry JSON is not valid JSON: Expecting value"),
        ("[]", "router registry JSON must be an object with keys 'version' and 'routers'"),
        ('{"version": 2, "routers": []}', r"router registry JSON version 2 is not supported \(1\)"),
        ('{"version": 1}', "router registry JSON must be an object with keys 'version' and 'routers'"),
        (
            '{"version": 1, "routers": [{"name": "a", "host": "h", "port": 1, "colour": "red"}]}',
            r"unknown ModelRoute keys \['colour'\]; valid: name, host, port",
        ),
        ('{"version": 1, "routers": [{"name": "a", "host": "h"}]}', "ModelRoute is missing port"),
    ],
)
def test_from_json_is_strict(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterRegistry.from_json(text)


_names = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=12)
_hosts = st.one_of(
    st.ip_addresses().map(str),
    st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z0-9-]{1,8}){0,2}", fullmatch=True),
)
_routes = st.builds(
    ModelRoute,
    name=_names,
    host=_hosts,
    port=st.integers(1, 65535),
    policy=st.sampled_from(ROUTER_POLICIES),
    pd_disaggregation=st.booleans(),
)


@given(st.lists(_routes, max_size=6, unique_by=lambda r: r.name))
def test_round_trip_property(routes: list[ModelRoute]) -> None:
    reg = RouterRegistry(routes)
    again = RouterRegistry.from_env(reg.to_env())
    assert dict(again) == dict(reg)
    for r in routes:
        url = again.get_model_url(r.name, "/x")
        assert url.endswith(f":{r.port}/x")
        assert ("[" in url) == (":" in r.host)
