"""``hydra/launcher=sglang_packed``: GPU needs from plans, GPU claims across launches, and sweeps of the test app
(tests/sweep_app) with stand-in engines: concurrent jobs on disjoint GPUs, never a GPU given twice (within a
launch and across two launches at once), a failed job freeing its GPUs, a job larger than the launcher's GPUs
marked failed, bad settings refused before any job runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.rendering.claims import ClaimCheck
from miles_sglang_plugin.sweeps.gpu_claims import GpuClaims, GpuLockDirError
from miles_sglang_plugin.sweeps.packing import gpu_need, gpus_of_setting

APP = Path(__file__).resolve().parent / "sweep_app" / "app.py"


# --------------------------------------------------------------------------------------------------------
# Needs and claims


@pytest.mark.parametrize(
    ("overrides", "need"),
    [
        (["debug_rollout_only=true", "sglang.actor.regular.num_gpus=4", "rollout_num_gpus_per_engine=2"], 4),
        # 4 training GPUs on the node, then the rollout's local GPUs 4..7: the job needs all 8 of the node
        (
            ["actor_num_gpus_per_node=4", "sglang.actor.regular.num_gpus=4", "rollout_num_gpus_per_engine=2"],
            8,
        ),
        # 8 training GPUs fill node 0; the rollout's 2 GPUs are local GPUs 0, 1 of node 1
        (["sglang.actor.regular.num_gpus=2", "rollout_num_gpus_per_engine=2"], 2),
        # a placeholder reserves GPUs too: actor 6 + placeholder 2 = local GPUs 0..7
        (["debug_rollout_only=true", "sglang=placeholder"], 8),
    ],
)
def test_a_jobs_gpu_need_is_the_highest_local_gpu_of_its_rollout_plus_one(
    overrides: list[str], need: int
) -> None:
    plan = resolve_config(compose_config(["hf_checkpoint=/m", *overrides]))
    assert gpu_need(plan) == need


def test_gpu_claims_keep_launches_apart_and_are_all_or_none(tmp_path: Path) -> None:
    first, second = GpuClaims(tmp_path), GpuClaims(tmp_path)
    assert first.claim(["0", "1", "2", "3"], 2) == ["0", "1"]
    assert second.claim(["0", "1", "2", "3"], 2) == ["2", "3"]
    assert second.claim(["0", "1"], 1) is None  # held by the first launch
    assert second.claim(["3", "4", "5"], 3) is None and set(second.fds) == {"2", "3"}  # none taken
    first.release(["0"])
    assert second.claim(["0", "1"], 1) == ["0"]
    assert not first.try_claim("1")  # never given twice, even to the launch that holds it


def test_a_released_gpu_is_free_although_a_forked_job_has_a_copy_of_its_lock(tmp_path: Path) -> None:
    """The job holds a copy of the lock file's descriptor (unlocked for every copy at release); its copy of the
    claim's guard it closed as it was forked, before any of its own code ran (so: once it says it runs)."""
    claims, other = GpuClaims(tmp_path), GpuClaims(tmp_path)
    assert claims.claim(["7"], 1) == ["7"]
    read, write = os.pipe()
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the job: holds a copy of the descriptor until told to exit
        os.close(write)
        os.write(started_write, b"s")
        os.read(read, 1)
        os._exit(0)
    os.close(started_write)
    try:
        assert os.read(started_read, 1) == b"s"
        assert not other.try_claim("7")
        claims.release(["7"])
        assert other.try_claim("7")
    finally:
        os.close(read)
        os.close(write)
        os.close(started_read)
        os.waitpid(pid, 0)


def test_removing_the_lock_directory_never_gives_a_held_gpu_to_another_launch(tmp_path: Path) -> None:
    """Issue 23: after ``rm -rf`` of the directory a second launch made new lock files and got GPUs 0,1 while
    the first launch's job ran on them. The claims' guards outlive the files."""
    locks = tmp_path / "locks"
    first = GpuClaims(locks)
    assert first.claim(["0", "1", "2", "3"], 2) == ["0", "1"]
    shutil.rmtree(locks)
    second = GpuClaims(locks)
    assert second.claim(["0", "1", "2", "3"], 2) == ["2", "3"]
    assert second.claim(["0", "1"], 1) is None and second.held_elsewhere == ["0", "1"]
    # the first launch notices, makes its lock files again and keeps its GPUs
    assert first.verify() == ClaimCheck(remade=("0", "1"))
    assert first.replaced == 1 and first.verify() == ClaimCheck()
    assert sorted(p.name for p in locks.iterdir() if p.name.startswith("gpu-")) == [
        f"gpu-{i}.lock" for i in range(4)
    ]
    first.release(["0"])
    assert second.claim(["0", "1"], 1) == ["0"]
    # a directory replaced (moved away, a new one made) is the same case
    locks.rename(tmp_path / "moved")
    locks.mkdir(mode=0o700)
    assert GpuClaims(locks).claim(["0", "1", "2", "3", "4"], 1) == ["4"]


def test_a_launch_goes_on_claiming_after_its_lock_directory_was_removed(tmp_path: Path) -> None:
    """Issue 23: the first launch kept its descriptor of the removed directory, could make no lock file in it
    and waited for ever for GPUs nobody held."""
    locks = tmp_path / "locks"
    claims = GpuClaims(locks)
    assert claims.claim(["0"], 1) == ["0"]
    shutil.rmtree(locks)
    assert claims.claim(["0", "1"], 1) == ["1"] and claims.replaced == 1 and claims.unusable_gpus == {}
    assert (locks / "gpu-1.lock").is_file()


def test_a_claim_whose_new_lock_file_another_process_took_is_reported_lost_once(tmp_path: Path) -> None:
    """A process that does not share the guards (another network namespace, an older version) can take the new
    lock file: the holder says so, once, and makes the file its own again once it is free."""
    locks = tmp_path / "locks"
    claims = GpuClaims(locks)
    assert claims.claim(["0"], 1) == ["0"]
    shutil.rmtree(locks)
    locks.mkdir(mode=0o700)
    other = os.open(locks / "gpu-0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        assert claims.verify() == ClaimCheck(lost=("0",))
        assert claims.verify() == ClaimCheck()
    finally:
        os.close(other)
    assert claims.verify() == ClaimCheck(remade=("0",))
    claims.release_all()


def test_a_guard_dies_with_its_process(tmp_path: Path) -> None:
    """Like the lock itself: a launch killed with SIGKILL leaves no claim behind."""
    code = (
        "import sys, time; from pathlib import Path; from miles_sglang_plugin.sweeps.gpu_claims import GpuClaims;"
        "c = GpuClaims(Path(sys.argv[1])); assert c.claim(['5'], 1); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        shutil.rmtree(tmp_path)
        assert GpuClaims(tmp_path).claim(["5"], 1) is None
    finally:
        holder.kill()
        holder.wait()
    assert GpuClaims(tmp_path).claim(["5"], 1) == ["5"]


def test_the_gpu_lock_directory_is_as_safe_as_the_ports_one(tmp_path: Path) -> None:
    """Made 0700; refused when others may write in it (left as it is) or when a symlink (nothing written where
    it points); lock files never followed."""
    GpuClaims(tmp_path / "new").check_usable()
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o1777)
    with pytest.raises(GpuLockDirError) as info:
        GpuClaims(loose).check_usable()
    assert str(info.value) == (
        f"the GPU lock directory {loose} is not usable: others may write in it (mode 1777); give a directory "
        "of this user's own, not a shared one"
    )
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o1777
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    refused = (
        f"the GPU lock directory {tmp_path / 'link'} is not usable: it is a symlink; use a real directory"
    )
    with pytest.raises(GpuLockDirError) as info:
        GpuClaims(tmp_path / "link").check_usable()
    assert str(info.value) == refused
    linked = GpuClaims(tmp_path / "link")
    assert not linked.try_claim("0") and str(linked.unusable) == "it is a symlink; use a real directory"
    assert list((tmp_path / "elsewhere").iterdir()) == []
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / "gpu-3.lock").symlink_to(tmp_path / "victim")
    claims = GpuClaims(locks)
    assert not claims.try_claim("3") and "Too many levels of symbolic links" in str(claims.unusable)
    assert not (tmp_path / "victim").exists()
    assert claims.claim(["3", "4"], 1) == ["4"]


def test_the_launchers_gpus_from_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpus_of_setting(None) == (["4", "5", "6", "7"], [])
    assert gpus_of_setting(2) == (["4", "5"], [])
    assert gpus_of_setting("1,3") == (["1", "3"], [])
    assert gpus_of_setting(5)[1] == ["gpus: 5 GPUs asked for, but this machine shows 4: 4,5,6,7"]
    assert gpus_of_setting([0, 0])[1] == [
        "gpus: [0, 0] names GPU 0 twice (entries 1 and 2): engines would share it; list each GPU once"
    ]
    assert gpus_of_setting(0)[1] == ["gpus: 0 must be a count in 1..4096"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_of_setting(8) == ([str(i) for i in range(8)], [])  # none visible: stand-ins' ids 0..7
    assert "none found" in gpus_of_setting(None)[1][0]


@pytest.mark.parametrize(
    ("visible", "problem"),
    [
        ("0,0", "'0,0' names GPU 0 twice (entries 1 and 2): engines would share it; list each GPU once"),
        ("3,3", "'3,3' names GPU 3 twice (entries 1 and 2): engines would share it; list each GPU once"),
        ("GPU-x,GPU-x", "'GPU-x,GPU-x' names GPU GPU-x twice (entries 1 and 2)"),
        ("0,,1", "'0,,1' has an empty entry (entry 2, a stray comma?)"),
        ("-1", "'-1' has entry 1 (-1), which is not a GPU: CUDA hides it and every GPU after it"),
        ("0,GPU-1a2b", "'0,GPU-1a2b' mixes GPU indices (0) with UUIDs"),
    ],
)
def test_the_launchers_visible_gpus_must_be_distinct(
    visible: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: ``gpus: null`` on ``CUDA_VISIBLE_DEVICES=0,0`` waited for ever for "2 free GPUs"."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for setting in (None, 1):
        gpus, problems = gpus_of_setting(setting)
        assert gpus is None and len(problems) == 1
        assert problems[0].startswith(f"gpus: the launcher's CUDA_VISIBLE_DEVICES={problem}")


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("'0,,1'", "gpus: '0,,1' has an empty entry (entry 2, a stray comma?)"),
        ("[0,-1]", "gpus: [0, -1] has entry 2 (-1), which is not a GPU"),
        ("[GPU-1a2b,1]", "gpus: ['GPU-1a2b', 1] mixes GPU indices (1) with UUIDs"),
    ],
)
def test_the_launchers_gpu_setting_must_name_distinct_gpus(setting: str, problem: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_override(f"gpus={setting}").value()
    gpus, problems = gpus_of_setting(value)
    assert gpus is None and len(problems) == 1 and problems[0].startswith(problem)


def test_two_gpu_names_never_share_a_lock_file(tmp_path: Path) -> None:
    """``MIG-GPU-a/1/0`` and ``MIG-GPU-a_1_0`` had one lock file: a job needing both waited for ever."""
    claims = GpuClaims(tmp_path)
    assert claims.claim(["MIG-GPU-a/1/0", "MIG-GPU-a_1_0"], 2) == ["MIG-GPU-a/1/0", "MIG-GPU-a_1_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu-MIG-GPU-a%2F1%2F0.lock",
        "gpu-MIG-GPU-a_1_0.lock",
    ]
    assert claims.lock_file_name("0") == "gpu-0.lock"  # as before: launches of older versions keep apart
    claims.release_all()


# --------------------------------------------------------------------------------------------------------
# Sweeps of the test app


def run_sweep(sweep: Path, *args: str, lock_dir: Path, background: bool = False) -> Any:
    env = {**os.environ, "MSP_GPU_LOCK_DIR": str(lock_dir)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    argv = [sys.executable, str(APP), "-m", "hydra/launcher=sglang_packed", f"hydra.sweep.dir={sweep}", *args]
    options: dict[str, Any] = {"cwd": APP.parent, "env": env, "stdin": subprocess.DEVNULL, "text": True}
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options)
    return subprocess.run(argv, capture_output=True, timeout=300, **options)


def records(sweep: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job_record.json"))]


def overlapping(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def gpu_set(record: dict[str, Any]) -> set[str]:
    return set(record["cuda_visible_devices"].split(","))


@pytest.fixture(scope="module")
def packed_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """4 jobs of 4 GPUs each on 8 GPUs: two at a time."""
    base = tmp_path_factory.mktemp("packed")
    result = run_sweep(
        base / "sweep", "hydra.launcher.gpus=8", "hold_s=1.5,1.5,1.5,1.5", lock_dir=base / "locks"
    )
    return base / "sweep", result


def test_concurrent_jobs_run_on_disjoint_gpu_slices(packed_sweep: tuple[Path, Any]) -> None:
    sweep, result = packed_sweep
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = records(sweep)
    assert len(jobs) == 4
    for job in jobs:
        assert len(gpu_set(job)) == 4 and gpu_set(job) <= {str(i) for i in range(8)}
        assert job["packed_gpus"] == job["cuda_visible_devices"]
    pairs = [(a, b) for a, b in combinations(jobs, 2) if overlapping(a, b)]
    assert len(pairs) >= 2  # they did run side by side
    for a, b in pairs:
        assert not gpu_set(a) & gpu_set(b), (a, b)
    assert "needs 4 GPUs" in result.stderr + result.stdout


def test_engines_report_their_jobs_gpus_disjoint_across_concurrent_jobs(
    packed_sweep: tuple[Path, Any],
) -> None:
    sweep, result = packed_sweep
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = records(sweep)
    for job in jobs:
        slice_ = job["cuda_visible_devices"].split(",")
        # plan local GPUs 0,1 and 2,3 index into the job's slice
        assert sorted(e["reported"] for e in job["engines"]) == [",".join(slice_[0:2]), ",".join(slice_[2:4])]
    for a, b in combinations(jobs, 2):
        if overlapping(a, b):
            reported_a = {g for e in a["engines"] for g in e["reported"].split(",")}
            reported_b = {g for e in b["engines"] for g in e["reported"].split(",")}
            assert not reported_a & reported_b


def test_two_launches_at_once_never_share_a_gpu(tmp_path: Path) -> None:
    """Each launch has GPUs 0..7 and jobs of 6: across both, only one job can hold GPUs at a time."""
    args = ("hydra.launcher.gpus=8", "sglang.actor.regular.num_gpus=6", "hold_s=0.5,0.5")
    first = run_sweep(tmp_path / "a", *args, lock_dir=tmp_path / "locks", background=True)
    second = run_sweep(tmp_path / "b", *args, lock_dir=tmp_path / "locks", background=True)
    outputs = [p.communicate(timeout=300)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    jobs = records(tmp_path / "a") + records(tmp_path / "b")
    assert len(jobs) == 4 and all(len(gpu_set(j)) == 6 for j in jobs)
    for a, b in combinations(jobs, 2):
        assert not (overlapping(a, b) and gpu_set(a) & gpu_set(b)), (a, b)


def _wait_for_engines(record: Path, launch: subprocess.Popen) -> None:
    """Until the job's record lists its engines (its deployment is up), or its launch ended."""
    while launch.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if "engines" in json.loads(record.read_text()):
                return
        time.sleep(0.2)


def test_removing_the_lock_directory_mid_sweep_never_gives_a_gpu_to_two_sweeps(tmp_path: Path) -> None:
    """Issue 23: the directory removed while the first sweep's job ran; a second sweep then got its GPUs
    (8 s of overlap), and the first sweep waited for ever. Jobs of 6 of the 8 GPUs: no two can run at once."""
    locks, six = tmp_path / "locks", "sglang.actor.regular.num_gpus=6"
    first = run_sweep(
        tmp_path / "a", "hydra.launcher.gpus=8", six, "hold_s=8,0", lock_dir=locks, background=True
    )
    launches = [first]
    try:
        _wait_for_engines(tmp_path / "a" / "0" / "job_record.json", first)
        shutil.rmtree(locks)
        launches.append(
            run_sweep(
                tmp_path / "b", "hydra.launcher.gpus=8", six, "hold_s=0,0", lock_dir=locks, background=True
            )
        )
        outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()  # its jobs get SIGTERM with it (PR_SET_PDEATHSIG)
                launch.communicate()
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    jobs = records(tmp_path / "a") + records(tmp_path / "b")
    assert len(jobs) == 4 and all("end" in job for job in jobs)
    for a, b in combinations(jobs, 2):
        assert not (overlapping(a, b) and gpu_set(a) & gpu_set(b)), (a, b)
    assert (
        f"the GPU lock directory {locks} was removed or replaced while this launch held GPUs 0,1,2,3,4,5 "
        "(job #0): their lock files are made again" in outputs[0]
    )


def test_a_failed_job_frees_its_gpus_and_the_sweep_goes_on(tmp_path: Path) -> None:
    result = run_sweep(
        tmp_path / "sweep",
        "hydra.launcher.gpus=4",
        "hold_s=0",
        "fail_while_serving=true,false",
        lock_dir=tmp_path,
    )
    assert result.returncode == 1  # the multirun fails at its end, after every job ran
    status = json.loads((tmp_path / "sweep" / "0" / "job_status.json").read_text())
    assert status == {"status": "FAILED", "error": "RuntimeError: asked to fail while serving"}
    jobs = records(tmp_path / "sweep")
    assert [j["cuda_visible_devices"] for j in jobs] == ["0,1,2,3", "0,1,2,3"] and "end" in jobs[1]
    assert "asked to fail while serving" in result.stderr


def test_a_job_larger_than_the_launchers_gpus_is_marked_failed_and_the_others_run(tmp_path: Path) -> None:
    result = run_sweep(
        tmp_path / "sweep",
        "hydra.launcher.gpus=4",
        "hold_s=0",
        "sglang.actor.regular.num_gpus=8,4",
        lock_dir=tmp_path,
    )
    assert result.returncode == 1
    status = json.loads((tmp_path / "sweep" / "0" / "job_status.json").read_text())
    assert status["status"] == "FAILED"
    assert status["error"] == (
        "PackedLaunchError: job #0 needs 8 GPUs for its deployment, but the launcher has 4 (hydra.launcher.gpus): "
        "it cannot run"
    )
    assert not (tmp_path / "sweep" / "0" / "job_record.json").exists()  # never ran
    assert [j["cuda_visible_devices"] for j in records(tmp_path / "sweep")] == ["0,1,2,3"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hydra.launcher.gpus=[0,0]"], "gpus: [0, 0] names GPU 0 twice (entries 1 and 2)"),
        (
            ["hydra.launcher.gpus=2", "hydra.launcher.max_parallel=0"],
            "max_parallel: 0 must be null or an integer >= 1",
        ),
        (["hydra.launcher.gpus=null"], "gpus: none found (no CUDA_VISIBLE_DEVICES, no nvidia-smi)"),
    ],
)
def test_bad_launcher_settings_stop_the_sweep_before_any_job(
    tmp_path: Path, args: list[str], message: str
) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MSP_GPU_LOCK_DIR": str(tmp_path / "locks")}
    result = subprocess.run(
        [
            sys.executable,
            str(APP),
            "-m",
            "hydra/launcher=sglang_packed",
            f"hydra.sweep.dir={tmp_path / 's'}",
            *args,
        ],
        cwd=APP.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not list((tmp_path / "s").glob("*/.hydra"))


@pytest.mark.parametrize("visible", ["0,0", "GPU-x,GPU-x"])
def test_a_sweep_on_visible_gpus_listed_twice_stops_before_any_job(tmp_path: Path, visible: str) -> None:
    """Issue 23: it waited for ever ("#0 waits for 2 free GPUs (others are held by other launches)")."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "MSP_GPU_LOCK_DIR": str(tmp_path / "locks")}
    argv = [sys.executable, str(APP), "-m", "hydra/launcher=sglang_packed", f"hydra.sweep.dir={tmp_path / 's'}",
            "sglang.actor.regular.num_gpus=2", "hold_s=0"]  # fmt: skip
    result = subprocess.run(argv, cwd=APP.parent, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"gpus: the launcher's CUDA_VISIBLE_DEVICES='{visible}' names GPU" in result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "s").glob("*/.hydra"))


def test_a_job_that_can_never_get_its_gpus_fails_saying_why_and_the_others_run(tmp_path: Path) -> None:
    """GPU 1's lock file cannot be opened (a symlink, never followed): a job of 2 GPUs can never be placed on
    the launcher's 2, so it fails at once instead of waiting for ever; the job of 1 GPU runs on GPU 0."""
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / "gpu-1.lock").symlink_to(tmp_path / "elsewhere")
    result = run_sweep(tmp_path / "sweep", "hydra.launcher.gpus=2", "hold_s=0", "rollout_num_gpus_per_engine=1",
                       "sglang.actor.regular.num_gpus=2,1", lock_dir=locks)  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    status = json.loads((tmp_path / "sweep" / "0" / "job_status.json").read_text())
    assert status == {
        "status": "FAILED",
        "error": f"PackedLaunchError: job #0 needs 2 GPUs, but only 1 of the launcher's 2 can be claimed: their "
        f"lock files cannot be opened (GPU 1: {locks / 'gpu-1.lock'}: Too many levels of symbolic links): it "
        "cannot run",
    }
    assert not (tmp_path / "sweep" / "0" / "job_record.json").exists()  # never ran
    assert [j["cuda_visible_devices"] for j in records(tmp_path / "sweep")] == ["0"]
    assert not (tmp_path / "elsewhere").exists()


def test_the_plugin_module_hydra_imports_in_every_app_stays_light() -> None:
    code = (
        "import sys, hydra_plugins.miles_sglang_plugin.sglang_sweeps; "
        "print(sorted(m for m in sys.modules if m.startswith('miles_sglang_plugin.'))); "
        "print([m for m in ('matplotlib', 'httpx', 'rich', 'aiohttp', 'numpy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # config.store (with config.locating) stores the nodes unbuilt; the group's own plugin module imports it too
    assert out.splitlines() == [
        "['miles_sglang_plugin.config', 'miles_sglang_plugin.config.locating', 'miles_sglang_plugin.config.store', "
        "'miles_sglang_plugin.sweeps', 'miles_sglang_plugin.sweeps.conf']",
        "[]",
    ]
