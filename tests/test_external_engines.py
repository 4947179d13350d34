"""External engines (engines that already run elsewhere, served by a model's router) and models without local
engines (issue 11 item 4): resolution, the Hydra, Miles-YAML and argparse inputs, rendering of the router.

Served, health-checked, controlled and left running by a live deployment: ``test_external_engines_live.py``."""

from __future__ import annotations

import json

import pytest

from miles_sglang_plugin.app.hydra_edge import prepare_from_config, resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.deployment_spec import ExternalEngineSpec, WorkerType
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.miles.argparse_bridge import resolve_namespace
from miles_sglang_plugin.planning.external import normalise_engine_url
from miles_sglang_plugin.planning.resolution import NO_ENGINES_ZERO_ROLLOUT, resolve_deployment
from tests.conftest import group, model, spec
from tests.test_argparse_bridge import miles_namespace

T = TrainerInputs


def with_external(m, *entries: ExternalEngineSpec | str):
    return type(m)(
        **{
            **m.__dict__,
            "external": tuple(
                e if isinstance(e, ExternalEngineSpec) else ExternalEngineSpec(e) for e in entries
            ),
        }
    )


def problems(exc: pytest.ExceptionInfo[DeploymentConfigError]) -> dict[str, str]:
    return {p.key: p.message for p in exc.value.problems}


def test_a_model_with_external_engines_only_has_a_router_and_no_gpus() -> None:
    actor = model("actor", group("regular", 2))
    judge = with_external(model("judge", path="/judge"), "127.0.0.1:9001", "http://10.0.0.5:9002/")
    plan = resolve_deployment(spec(actor, judge), T(hf_checkpoint="/ckpt", debug_rollout_only=True))
    judge_plan = plan.model("judge")
    assert [(e.id, e.url, e.worker_type) for e in judge_plan.external] == [
        ("judge.external.0", "http://127.0.0.1:9001", WorkerType.regular),
        ("judge.external.1", "http://10.0.0.5:9002", WorkerType.regular),
    ]
    assert (judge_plan.num_gpus, judge_plan.engines, judge_plan.has_router, judge_plan.is_pd) == (
        0,
        (),
        True,
        False,
    )
    assert (judge_plan.model_path, judge_plan.update_weights) == ("/judge", False)
    assert (plan.total_gpus, [e.id for e in plan.engines]) == (2, ["actor.regular.0", "actor.regular.1"])


def test_an_external_only_model_serving_the_checkpoint_receives_weights() -> None:
    """slime's ExternalRolloutServer("default", update_weights=True): the model path falls back to
    hf_checkpoint, so update_weights is inferred true."""
    plan = resolve_deployment(spec(with_external(model("actor"), "h:1")), T(hf_checkpoint="/ckpt"))
    assert (plan.model("actor").model_path, plan.model("actor").update_weights) == ("/ckpt", True)


def test_pd_external_engines_make_a_pd_router() -> None:
    actor = with_external(
        model("actor"),
        ExternalEngineSpec("h:1", "prefill", 8998),
        ExternalEngineSpec("h:2", "decode"),
    )
    plan = resolve_deployment(spec(actor), T(hf_checkpoint="/ckpt"))
    assert plan.model("actor").is_pd
    assert [(e.worker_type.value, e.bootstrap_port) for e in plan.model("actor").external] == [
        ("prefill", 8998),
        ("decode", None),
    ]


def test_a_model_without_groups_or_external_engines_is_still_refused() -> None:
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 2)), model("judge")), T(hf_checkpoint="/c"))
    assert list(problems(exc)) == ["sglang.judge"]
    assert problems(exc)["sglang.judge"].startswith("has no server groups and no external engines")
    assert "sglang.judge.external=[http://HOST:PORT, ...]" in problems(exc)["sglang.judge"]


def test_external_engine_mistakes_are_all_reported() -> None:
    bad = with_external(
        model("judge"),
        ExternalEngineSpec("http://h:1/generate", key="sglang.judge.external[0]"),
        ExternalEngineSpec("h", key="sglang.judge.external[1]"),
        ExternalEngineSpec("ftp://h:1", key="sglang.judge.external[2]"),
        ExternalEngineSpec("h:5", "placeholder", key="sglang.judge.external[3]"),
        ExternalEngineSpec("h:6", "regular", 8998, key="sglang.judge.external[4]"),
        ExternalEngineSpec("h:7", key="sglang.judge.external[5]"),
    )
    other = with_external(model("ref"), ExternalEngineSpec("http://h:7", key="sglang.ref.external[0]"))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(bad, other), T(hf_checkpoint="/c"))
    got = problems(exc)
    assert sorted(got) == [
        "sglang.judge.external[0]",
        "sglang.judge.external[1]",
        "sglang.judge.external[2]",
        "sglang.judge.external[3].worker_type",
        "sglang.judge.external[4].bootstrap_port",
        "sglang.ref.external[0]",
    ]
    assert "not an engine's base URL" in got["sglang.judge.external[0]"]
    assert got["sglang.ref.external[0]"] == (
        "http://h:7 is already an external engine at sglang.judge.external[5]; give each engine once"
    )
    assert got["sglang.judge.external[4].bootstrap_port"] == "is only for prefill engines, not 'regular'"


def test_external_engines_follow_the_pd_rules() -> None:
    mixed = with_external(model("actor", group("prefill", 2), group("decode", 2)), "h:1")
    lonely = with_external(model("ref"), ExternalEngineSpec("h:2", "prefill"))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(mixed, lonely), T(hf_checkpoint="/c", debug_rollout_only=True))
    assert "mixes regular groups with prefill/decode groups" in problems(exc)["sglang.actor"]
    assert (
        problems(exc)["sglang.ref"] == "has prefill groups but no decode group; PD disaggregation needs both"
    )


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("https://engine.example:443/", "https://engine.example:443"),
        ("[::1]:8000", "http://[::1]:8000"),
        ("http://h", None),
        ("http://h:1/v1", None),
        ("http://h:1?x=1", None),
        ("http://u:p@h:1", None),
        ("http://h:99999", None),
        ("", None),
        (8000, None),
    ],
)
def test_engine_urls(url: object, normalised: str | None) -> None:
    assert normalise_engine_url(url) == normalised


# ----------------------------------------------------------------------------------------- the inputs
def test_hydra_external_list_with_urls_and_mappings() -> None:
    cfg = compose_config(
        [
            "hf_checkpoint=/ckpt",
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=2",
            "+sglang_model@sglang.judge=base",
            "sglang.judge.model_path=/judge",
            'sglang.judge.external=["127.0.0.1:9001",{url:"http://127.0.0.1:9002",worker_type:regular}]',
        ]
    )
    prepared = prepare_from_config(cfg)
    judge = prepared.plan.model("judge")
    assert [e.url for e in judge.external] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    router = prepared.launch.router("judge")
    assert [(w.url, w.worker_type) for w in router.workers] == [
        ("http://127.0.0.1:9001", "regular"),
        ("http://127.0.0.1:9002", "regular"),
    ]
    assert router.spec.port not in (prepared.launch.router("actor").spec.port,)
    data = json.loads(json.dumps(prepared.to_dict()))
    assert data["models"]["judge"]["external"][1] == {
        "id": "judge.external.1",
        "url": "http://127.0.0.1:9002",
        "worker_type": "regular",
        "bootstrap_port": None,
    }
    assert data["models"]["judge"]["router"]["workers"][0]["url"] == "http://127.0.0.1:9001"


def test_hydra_external_entry_with_an_unknown_key() -> None:
    cfg = compose_config(
        ["hf_checkpoint=/c", "+sglang_model@sglang.judge=base", 'sglang.judge.external=[{url:"h:1",port:2}]']
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(cfg)
    assert problems(exc)["sglang.judge.external[0]"] == (
        "unknown key(s) ['port']; an external engine has ['url', 'worker_type', 'bootstrap_port']"
    )


def test_slime_and_miles_external_engine_addresses() -> None:
    ns = miles_namespace(
        rollout_external=True,
        rollout_external_engine_addrs=["10.0.0.1:30000", "10.0.0.2:30000"],
        hf_checkpoint="/ckpt",
        rollout_num_gpus=16,
    )
    plan = resolve_namespace(ns)
    (default,) = plan.models
    assert (default.name, default.update_weights, default.engines) == ("default", True, ())
    assert [e.url for e in default.external] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(miles_namespace(rollout_external=True, hf_checkpoint="/ckpt"))
    assert list(problems(exc)) == ["rollout_external_engine_addrs"]


def test_zero_rollout_gpus_without_a_deployment_starts_nothing() -> None:
    """Newer Miles: rollout_num_gpus=0 without a config gives no models; with an eval fleet, the eval fleet
    alone (slime gives a router with no engines, which nothing here could fill)."""
    plan = resolve_deployment(None, T(hf_checkpoint="/c", rollout_num_gpus=0))
    assert (plan.models, plan.total_gpus, plan.notes) == ((), 0, (NO_ENGINES_ZERO_ROLLOUT,))
    plan = resolve_deployment(None, T(hf_checkpoint="/c", rollout_num_gpus=0, eval_num_gpus=4))
    assert [(m.name, m.num_gpus, m.is_eval) for m in plan.models] == [("eval", 4, True)]
    assert (plan.rollout_num_gpus, plan.total_gpus) == (0, 4)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(hf_checkpoint="/c", rollout_num_gpus=None))
    assert problems(exc)["rollout_num_gpus"].startswith(
        "must be >= 0 when no sglang deployment is given (got None)"
    )


def test_zero_rollout_gpus_with_a_deployment_that_holds_no_engines_starts_nothing() -> None:
    """On the Hydra path the deployment is always given (the default preset): with rollout_num_gpus=0 its model
    has no group, and a deployment of models without groups or external engines (or none at all) starts
    nothing, as Miles' rule for rollout_num_gpus=0 does, instead of being refused."""
    for given, names in ((spec(model("actor")), "actor"), (spec(), "none")):
        plan = resolve_deployment(given, T(hf_checkpoint="/c", rollout_num_gpus=0))
        assert (plan.models, plan.total_gpus, plan.rollout_num_gpus) == ((), 0, 0)
        assert plan.notes[-1].startswith(
            f"rollout_num_gpus=0 and the deployment holds no engines (models: {names};"
        )
    cfg = compose_config(["hf_checkpoint=/c", "rollout_num_gpus=0"])
    plan = resolve_config(cfg)
    assert plan.models == () and "models: actor;" in plan.notes[-1]
    # With an eval fleet the eval model starts alone, after the actor (newer Miles: rollout_num_gpus=0 and
    # eval_num_gpus > 0 give the eval fleet alone); the preset's empty model is left out with a note.
    cfg = compose_config(
        ["hf_checkpoint=/c", "rollout_num_gpus=0", "eval_num_gpus=2", "+sglang_model@sglang.eval=base",
         "sglang.eval.regular.num_gpus=2"]
    )  # fmt: skip
    plan = resolve_config(cfg)
    assert [(m.name, m.num_gpus) for m in plan.models] == [("eval", 2)]
    assert (plan.rollout_offset, plan.rollout_num_gpus, plan.total_gpus) == (
        8,
        0,
        2,
    )  # after the actor's 1 x 8
    assert [e.gpu_slots for e in plan.model("eval").groups[0].engines] == [(8,), (9,)]
    assert "model(s) actor hold no engines and do not start; the eval fleet starts alone" in plan.notes[-1]
    # Not when the trainer's rollout size is unset, nor when the groups hold GPUs the 0 contradicts.
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor")), T(hf_checkpoint="/c"))
    assert list(problems(exc)) == ["sglang.actor"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            spec(model("actor", group("regular", 8))), T(hf_checkpoint="/c", rollout_num_gpus=0)
        )
    assert list(problems(exc)) == ["rollout_num_gpus"]


def test_external_engines_cannot_be_exported_to_a_miles_config() -> None:
    from miles_sglang_plugin.miles.sglang_config import spec_to_miles_yaml

    judge = with_external(model("judge", path="/judge", update=False), "h:1")
    s = spec(model("actor", group("regular", 2)), judge)
    plan = resolve_deployment(s, T(hf_checkpoint="/c", debug_rollout_only=True))
    with pytest.raises(DeploymentConfigError) as exc:
        spec_to_miles_yaml(s, plan)
    assert list(problems(exc)) == ["sglang.judge.external"]
