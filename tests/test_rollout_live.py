"""The rollout client of a running deployment (stand-in engines, the real router of this run's gateway): an
engine or the router killed in the middle of a stream, the trainer's abort, weight versions after an update.

The expected tokens are an uninterrupted run's: the stand-ins' greedy tokens depend on the weights alone, so
any engine of the model, asked directly before anything is killed, gives them."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.rollout import RolloutClient, RolloutResult
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose
from tests.test_serving_faults import FAST, pid_of, stats, wait_until

PACED = [
    "sglang.actor.regular.num_gpus=2",
    "sglang_deploy.standin.speed.enabled=true",
    "sglang_deploy.standin.speed.decode_step_s=0.05",
    "sglang_deploy.standin.speed.decode_token_s=0.0",
]
PROMPT = [11, 22, 33, 44, 55]
GREEDY = {"max_new_tokens": 40, "temperature": 0}


def uninterrupted(d: Deployment, headers: dict[str, str] | None = None) -> list[int]:
    engine = d.engines()[0].url
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    return list(httpx.post(engine + "/generate", json=body, headers=headers, timeout=60).json()["output_ids"])


def engine_running_it(d: Deployment) -> str:
    """The engine with a generation request in flight (the test sends one at a time)."""
    (busy,) = [e.id for e in d.engines() if stats(e.url)["in_flight"] > 0]
    return busy


def test_an_engine_killed_under_a_request_through_the_router_loses_no_token(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs") as d:
        whole = uninterrupted(d)
        killed: list[str] = []

        def kill_at_20(target: str, count: int) -> None:
            if count >= 20 and not killed:
                killed.append(engine_running_it(d))
                os.kill(pid_of(d, killed[0]), signal.SIGKILL)

        with d.client("actor") as client:
            result = client.generate(PROMPT, sampling_params=GREEDY, on_tokens=kill_at_20)
        assert list(result.output_ids) == whole and len(whole) == 40
        assert killed and result.segments[0].end >= 20 and result.segments[-1].end == 40
        assert len(result.attempts) >= 2 and result.attempts[-1].outcome == "finished"
        assert result.attempts[-1].sent_tokens == 5 + (40 - result.attempts[-1].kept_tokens)


def test_the_router_killed_under_a_request_the_client_goes_on_at_an_engine(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs") as d:
        whole = uninterrupted(d)
        engines = {e.id for e in d.engines()}
        killed: list[int] = []

        def kill_router_at_10(target: str, count: int) -> None:
            if count >= 10 and not killed:
                killed.append(d.fleet.routers()[0].process.pid)
                os.kill(killed[0], signal.SIGKILL)

        with d.client("actor", router_retry_s=30) as client:
            result = client.generate(PROMPT, sampling_params=GREEDY, on_tokens=kill_router_at_10)
        assert list(result.output_ids) == whole
        assert result.attempts[0].target == "router actor" and result.segments[0].end >= 10
        assert result.attempts[-1].target in engines and result.attempts[-1].outcome == "finished"


def test_the_trainers_abort_ends_the_clients_requests_with_their_tokens(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """An abort through the control handle is the trainer ending a rollout step, not a loss: the request
    ends with what it has and is not sent again."""
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs") as d:
        aborts: list[threading.Thread] = []

        def abort_at_5(target: str, count: int) -> None:
            if count >= 5 and not aborts:
                aborts.append(threading.Thread(target=d.control.abort_all))
                aborts[0].start()

        with d.client("actor") as client:
            result = client.generate(
                PROMPT, sampling_params={"max_new_tokens": 400, "temperature": 0}, on_tokens=abort_at_5
            )
        aborts[0].join(60)
        assert result.aborted and 5 <= len(result.output_ids) < 400 and len(result.attempts) == 1
        assert sum(stats(e.url)["requests_received"].get("/abort_request", 0) for e in d.engines()) == 2


def test_the_engines_weight_versions_are_known_and_a_request_gets_the_one_it_asks_for(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs") as d:
        assert [e.weight_version for e in d.engines()] == ["default", "default"]
        with d.client("actor", version_wait_s=0.5) as client:
            before = client.generate(PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0})
            d.control.update_weights_from_disk("/ckpt/step2", weight_version="2")
            assert [e.weight_version for e in d.engines()] == ["2", "2"]
            after = client.generate(
                PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0}, min_version=2
            )
        assert before.weight_versions == ("default",) and after.weight_versions == ("2",)
        assert before.output_ids != after.output_ids  # the new weights make other tokens


def test_a_request_aborted_by_a_weight_update_goes_on_with_the_new_weights(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """A weight update that aborts the running requests: the request keeps its tokens of the old weights and
    goes on with the new ones; its segments say which version made which tokens."""
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs") as d:
        whole = uninterrupted(d)
        updates: list[threading.Thread] = []

        def update_at_10(target: str, count: int) -> None:
            if count >= 10 and not updates:
                kwargs = {"weight_version": "3", "abort_all_requests": True}
                updates.append(
                    threading.Thread(
                        target=d.control.update_weights_from_disk, args=("/ckpt/3",), kwargs=kwargs
                    )
                )
                updates[0].start()

        with d.client("actor") as client:
            result = client.generate(PROMPT, sampling_params=GREEDY, on_tokens=update_at_10)
        updates[0].join(60)
        first, last = result.segments[0], result.segments[-1]
        assert (first.weight_version, last.weight_version) == ("default", "3") and first.end >= 10
        assert list(result.output_ids[: first.end]) == whole[: first.end]
        assert "the engine aborted it" in result.attempts[0].outcome
        # The new weights' tokens are those an engine with them makes from the prompt and the tokens before.
        body = {
            "input_ids": PROMPT + list(result.output_ids[: last.start]),
            "sampling_params": {"max_new_tokens": 40 - last.start, "temperature": 0},
        }
        again = httpx.post(d.engines()[0].url + "/generate", json=body, timeout=60).json()
        assert list(result.output_ids[last.start :]) == again["output_ids"] and whole != list(
            result.output_ids
        )


def test_a_trainer_process_with_the_registry_and_the_engine_listing_survives_the_router(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """What a trainer subprocess gets (``rollout_env()``): the routers, and the engine listing the deployment
    serves; with them its client goes straight to an engine when the router is killed under a request."""
    cfg = compose(*PACED, *FAST, "sglang_deploy.api_key=sk-test-key")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        url = d.serve_discovery()
        env = d.rollout_env()
        assert env["MSP_RL_WORKERS"] == url and url.endswith("/v1/rl/workers") and "sk-test" not in str(env)
        assert httpx.get(url, timeout=10).status_code == 401
        listing = httpx.get(url, headers=d.auth_headers(), timeout=10).json()
        assert (listing["protocol_version"], listing["total"]) == (1, 2)
        assert [
            (w["id"], w["model_id"], w["worker_type"], w["health"], w["weight_version"])
            for w in listing["workers"]
        ] == [
            ("actor.regular.0", "actor", "regular", "ready", "default"),
            ("actor.regular.1", "actor", "regular", "ready", "default"),
        ]
        killed: list[int] = []

        def kill_router_at_10(target: str, count: int) -> None:
            if count >= 10 and not killed:
                killed.append(d.fleet.routers()[0].process.pid)
                os.kill(killed[0], signal.SIGKILL)

        client = RolloutClient.from_registry(
            "actor",
            env["MSP_ROUTERS"],
            api_key="sk-test-key",
            workers_url=env["MSP_RL_WORKERS"],
            router_retry_s=30,
        )
        with client:
            result = client.generate(PROMPT, sampling_params=GREEDY, on_tokens=kill_router_at_10)
        assert list(result.output_ids) == uninterrupted(d, d.auth_headers())
        assert result.attempts[-1].target in {"actor.regular.0", "actor.regular.1"}


def test_a_rolling_update_under_load_keeps_half_the_engines_serving_and_loses_no_request(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Four engines, four clients sending without pause, a rolling update with half of them kept serving and
    0.3 s to finish their requests (what is left is aborted and carried on by the client elsewhere): every
    request ends well, never fewer than two engines serve, every engine ends on the new weights."""
    cfg = compose(*PACED, "sglang.actor.regular.num_gpus=4", *FAST)
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        stop = threading.Event()
        results: list[RolloutResult] = []
        errors: list[BaseException] = []
        serving: list[int] = []

        def send() -> None:
            with d.client("actor") as client:
                while not stop.is_set():
                    try:
                        results.append(
                            client.generate(PROMPT, sampling_params={"max_new_tokens": 40, "temperature": 0})
                        )
                    except Exception as exc:  # counted: the test asks for none
                        errors.append(exc)

        def sample() -> None:
            while not stop.is_set():
                serving.append(sum(e.state == "serving" for e in d.state().engines))
                stop.wait(0.01)

        threads = [threading.Thread(target=send) for _ in range(4)] + [threading.Thread(target=sample)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(results) >= 8, "eight requests before the update")
            update = d.control.update_weights_from_disk(
                "/ckpt/step2", weight_version="2", rolling=True, min_serving_fraction=0.5, drain_timeout_s=0.3
            )
            done = len(results)
            wait_until(lambda: len(results) >= done + 8, "eight requests after the update")
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert not errors, errors[:3]
        assert update.ok and update.accepted == tuple(f"actor.regular.{i}" for i in range(4))
        assert serving and min(serving) >= 2
        assert [e.weight_version for e in d.engines()] == ["2"] * 4
        assert {s.weight_version for r in results for s in r.segments} <= {"default", "2"}
        assert results[-1].weight_versions == ("2",)
        # a request takes 2 s and each engine nearly always has one: some were cut at the end of a drain (0.3 s)
        # and went on elsewhere, keeping their tokens
        carried = [r for r in results if len(r.attempts) > 1]
        assert carried and all(len(r.output_ids) == 40 for r in carried)
        kinds = [e.kind for e in d.events()]
        assert kinds.count("engine_updating") == 4 and kinds.count("engine_updated") == 4


def test_a_relaunch_goes_on_with_the_trainers_version_and_a_restarted_engine_keeps_it(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """``initial_weight_version``: every engine starts with it (a restored step), a request may ask for it at
    once, an engine restarted after a loss has it again, and one ``apply`` adds starts with it too."""
    with launch_from_config(compose(*PACED, *FAST), log_dir=tmp_path / "logs", initial_weight_version=7) as d:
        assert [e.weight_version for e in d.engines()] == ["7", "7"]
        with d.client("actor", version_wait_s=0.5) as client:
            sampling = {"max_new_tokens": 4, "temperature": 0}
            assert client.generate(PROMPT, sampling_params=sampling, min_version=7).weight_versions == ("7",)
            since = len(d.events())
            os.kill(pid_of(d, "actor.regular.1"), signal.SIGKILL)
            d.wait_for_event("engine_recovered", subject="actor.regular.1", since=since, timeout_s=60)
            assert [e.weight_version for e in d.engines()] == ["7", "7"]
            assert stats(d.engines()[1].url)["weight_version"] == "7"
            d.resize("actor", "regular", 3)
            assert [e.weight_version for e in d.engines()] == ["7", "7", "7"]
            assert client.generate(PROMPT, sampling_params=sampling, min_version=7).weight_versions == ("7",)


def test_an_initial_weight_version_that_is_not_a_string_or_an_integer_is_refused(tmp_path: Path) -> None:
    pattern = "initial_weight_version must be a non-empty string or an integer"
    for bad in (True, 1.5, ""):
        with (
            pytest.raises(ValueError, match=pattern),
            launch_from_config(compose(*PACED), log_dir=tmp_path, initial_weight_version=bad),  # type: ignore[arg-type]
        ):
            raise AssertionError("started")
