"""An inherited CUDA_VISIBLE_DEVICES (a scheduler's GPUs, a sweep job's slice) is honoured by the local backend:
the plan's local GPU ids index into it, and a plan that needs more GPUs than it lists is refused before
anything starts."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import itertools
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.local import LocalBackend
from miles_sglang_plugin.backends.visible_gpus import inherited_visible_devices, restrict_to_visible
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.rendering.ports import PortClaims
from miles_sglang_plugin.serving.deployment import Deployment
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, prepare_unprobed

#: Two engines of 2 GPUs: local GPUs 0,1 and 2,3.
TWO_BY_TWO = ("sglang.actor.regular.num_gpus=4", "sglang.actor.num_gpus_per_engine=2")


def gpus(prepared) -> dict[str, str]:
    return {e.name: e.env["CUDA_VISIBLE_DEVICES"] for e in prepared.launch.engines}


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        (None, None),
        ("", ()),
        (" ", ()),
        ("4,5,6,7", ("4", "5", "6", "7")),
        (" 3, 1 ", ("3", "1")),
        ("GPU-1a2b, MIG-3c4d", ("GPU-1a2b", "MIG-3c4d")),
    ],
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


# ------------------------------------------------------------------------------------- lists refused (issue 23)
#: Two engines of 1 GPU: local GPUs 0 and 1 (a list of two entries is long enough for it).
TWO_BY_ONE = ("sglang.actor.regular.num_gpus=2", "sglang.actor.num_gpus_per_engine=1")
REFUSED = [
    ("0,0", "'0,0' names GPU 0 twice (entries 1 and 2): engines would share it; list each GPU once"),
    ("3,3", "'3,3' names GPU 3 twice (entries 1 and 2): engines would share it; list each GPU once"),
    (
        "GPU-x,GPU-x",
        "'GPU-x,GPU-x' names GPU GPU-x twice (entries 1 and 2): engines would share it; list each GPU once",
    ),
    (
        "0,00",
        "'0,00' names GPU 0 twice (entries 1 and 2: 0 and 00): engines would share it; list each GPU once",
    ),
    ("0,,1", "'0,,1' has an empty entry (entry 2, a stray comma?): every entry must name a GPU"),
    ("1,", "'1,' has an empty entry (entry 2, a stray comma?): every entry must name a GPU"),
    (
        "-1",
        "'-1' has entry 1 (-1), which is not a GPU: CUDA hides it and every GPU after it (an empty "
        "CUDA_VISIBLE_DEVICES means no GPU)",
    ),
    (
        "0,gpu1",
        "'0,gpu1' has entry 2 ('gpu1'), which is neither a GPU index (0, 1, ...) nor a GPU UUID (GPU-..., "
        "MIG-...): CUDA hides it and every GPU after it",
    ),
    (
        "0,GPU-1a2b",
        "'0,GPU-1a2b' mixes GPU indices (0) with UUIDs: one GPU could be in it twice under two names; use one "
        "kind",
    ),
    (
        "GPU-1a,GPU-1a2b",
        "'GPU-1a,GPU-1a2b' may name one GPU twice (entries 1 and 2: 'GPU-1a' and 'GPU-1a2b'; CUDA takes a "
        "UUID's first characters): give each GPU's whole UUID once",
    ),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED)
def test_a_list_that_does_not_name_distinct_gpus_is_refused(raw: str, message: str) -> None:
    with pytest.raises(DeploymentConfigError) as info:
        inherited_visible_devices({"CUDA_VISIBLE_DEVICES": raw})
    assert [(p.key, p.message) for p in info.value.problems] == [("CUDA_VISIBLE_DEVICES", message)]
    assert info.value.source == "the GPUs this process was given"


def test_every_problem_of_a_list_is_in_one_message() -> None:
    with pytest.raises(DeploymentConfigError) as info:
        inherited_visible_devices({"CUDA_VISIBLE_DEVICES": "2,,2,-1"})
    assert [p.message.split(" ", 1)[1] for p in info.value.problems] == [
        "has an empty entry (entry 2, a stray comma?): every entry must name a GPU",
        "has entry 4 (-1), which is not a GPU: CUDA hides it and every GPU after it (an empty "
        "CUDA_VISIBLE_DEVICES means no GPU)",
        "names GPU 2 twice (entries 1 and 3): engines would share it; list each GPU once",
    ]


def test_the_local_backend_refuses_a_gpu_listed_twice_before_it_claims_a_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a list of 2 entries a plan of 2 GPUs fits by count: only the check of the entries stops it putting
    both engines on GPU 0."""
    prepared, claims = prepare_unprobed(*TWO_BY_ONE)
    claims.release()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    own = PortClaims(tmp_path)
    backend = LocalBackend(claims=own)
    try:
        with pytest.raises(DeploymentConfigError, match="'0,0' names GPU 0 twice"):
            backend.prepare(prepared.plan, prepared.settings)
        assert own.fds == {}  # nothing claimed, nothing started
    finally:
        backend.close()
    with pytest.raises(DeploymentConfigError) as info:
        LocalBackend(visible_devices=["GPU-x", "GPU-x"])
    assert str(info.value.problems[0]) == (
        "visible_devices: 'GPU-x,GPU-x' names GPU GPU-x twice (entries 1 and 2): engines would share it; list "
        "each GPU once"
    )


@pytest.mark.parametrize("raw", ["3,3", "-1", "0,GPU-1a2b"])
def test_launch_refuses_such_a_list_with_status_2_and_starts_nothing(
    raw: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_sglang_plugin.cli import main

    started = []
    monkeypatch.setattr(Deployment, "start", lambda self: started.append(self) or pytest.fail("started"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", raw)
    assert main(["launch", "hf_checkpoint=/c", *TWO_BY_ONE, "sglang_deploy=simulated"]) == 2
    err = capsys.readouterr().err
    assert f"CUDA_VISIBLE_DEVICES: '{raw}'" in err and "Traceback" not in err
    assert started == []


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.lists(
        st.sampled_from(
            ["0", "1", "7", "00", "-1", "", " 2 ", "GPU-1a", "GPU-1a2b", "GPU-1A", "MIG-3c", "x", "1.5"]
        ),
        max_size=6,
    )
)
def test_a_list_is_accepted_only_when_it_names_distinct_gpus_of_one_kind(entries: list[str]) -> None:
    """Whatever the list: refused with problems under the variable's name, or accepted with entries that are
    all GPUs, all indices or all UUIDs, no two naming one GPU (equal as numbers, equal but for case, a prefix)."""
    try:
        got = inherited_visible_devices({"CUDA_VISIBLE_DEVICES": ",".join(entries)})
    except DeploymentConfigError as exc:
        assert exc.problems and all(p.key == "CUDA_VISIBLE_DEVICES" for p in exc.problems)
        return
    stripped = [e.strip() for e in entries]
    assert list(got) == stripped or (not got and stripped in ([], [""]))
    assert all(g.isdigit() or g.startswith(("GPU-", "MIG-")) for g in got)
    assert len({g.isdigit() for g in got}) <= 1
    assert len({int(g) for g in got if g.isdigit()}) == len([g for g in got if g.isdigit()])
    uuids = sorted(g.lower() for g in got if not g.isdigit())
    assert all(not b.startswith(a) for a, b in itertools.pairwise(uuids))  # a prefix sorts right before
