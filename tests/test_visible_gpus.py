"""An inherited CUDA_VISIBLE_DEVICES (a scheduler's GPUs, a sweep job's slice) is honoured by the local backend:
the plan's local GPU ids index into it, and a plan that needs more GPUs than it lists is refused before
anything starts."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.local import LocalBackend
from miles_sglang_plugin.backends.visible_gpus import inherited_visible_devices, restrict_to_visible
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.serving.deployment import Deployment
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, prepare_unprobed

#: Two engines of 2 GPUs: local GPUs 0,1 and 2,3.
TWO_BY_TWO = ("sglang.actor.regular.num_gpus=4", "sglang.actor.num_gpus_per_engine=2")


def gpus(prepared) -> dict[str, str]:
    return {e.name: e.env["CUDA_VISIBLE_DEVICES"] for e in prepared.launch.engines}


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [(None, None), ("", ()), ("4,5,6,7", ("4", "5", "6", "7")), (" 3, GPU-ab ,", ("3", "GPU-ab"))],
)
def test_the_inherited_list(raw: str | None, parsed: tuple[str, ...] | None) -> None:
    environ = {} if raw is None else {"CUDA_VISIBLE_DEVICES": raw}
    assert inherited_visible_devices(environ) == parsed


def test_local_ids_index_into_the_visible_list() -> None:
    prepared, claims = prepare_unprobed(*TWO_BY_TWO)
    claims.release()
    assert gpus(prepared) == {"actor.regular.0": "0,1", "actor.regular.1": "2,3"}
    assert gpus(restrict_to_visible(prepared, ("4", "5", "6", "7"))) == {
        "actor.regular.0": "4,5",
        "actor.regular.1": "6,7",
    }
    assert gpus(restrict_to_visible(prepared, ("7", "3", "1", "0", "2"))) == {
        "actor.regular.0": "7,3",
        "actor.regular.1": "1,0",
    }


def test_more_gpus_than_visible_is_an_error_naming_the_engines() -> None:
    prepared, claims = prepare_unprobed(*TWO_BY_TWO)
    claims.release()
    with pytest.raises(DeploymentConfigError) as exc:
        restrict_to_visible(prepared, ("4", "5", "6"))
    (problem,) = exc.value.problems
    assert problem.key == "CUDA_VISIBLE_DEVICES"
    assert problem.message.startswith(
        "this launcher may use 3 GPU(s) (4,5,6) but the plan needs local GPUs 0..3 on a node (engines "
        "actor.regular.1 lie beyond)"
    )
    with pytest.raises(DeploymentConfigError, match=r"may use 0 GPU\(s\) \(none\)"):
        restrict_to_visible(prepared, ())


@pytest.mark.slow
def test_engines_see_the_slice_they_were_given(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    leak_check: LeakTracker,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with launch_from_config(compose(*TWO_BY_TWO), log_dir=tmp_path / "logs") as d:
        assert [e.gpus for e in d.engines()] == ["4,5", "6,7"]
        reported = [
            httpx.get(e.url + "/server_info", timeout=10).json()["cuda_visible_devices"] for e in d.engines()
        ]
        assert reported == ["4,5", "6,7"]


@pytest.mark.slow
def test_too_few_visible_gpus_start_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    leak_check: LeakTracker,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    started = []
    monkeypatch.setattr(Deployment, "start", lambda self: started.append(self))
    with (
        pytest.raises(DeploymentConfigError, match="may use 2 GPU"),
        launch_from_config(compose(*TWO_BY_TWO)),
    ):
        pytest.fail("nothing should start")
    assert started == []


def test_an_explicit_list_wins_over_the_inherited_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    prepared, claims = prepare_unprobed(*TWO_BY_TWO)
    claims.release()
    backend = LocalBackend(visible_devices=("2", "3", "4", "5"))
    try:
        plan, settings = prepared.plan, prepared.settings
        assert gpus(backend.prepare(plan, settings)) == {"actor.regular.0": "2,3", "actor.regular.1": "4,5"}
    finally:
        backend.close()
