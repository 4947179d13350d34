"""The ``sglang_packed`` launcher's work: sweep jobs side by side on disjoint GPU sets.

1. Every job's sweep config is loaded and its deployment resolved before anything runs: the job needs the
   GPUs its plan's engines use on one machine (:func:`gpu_need`: the highest local GPU id of the rollout, plus
   one, so that the trainer's own GPUs before the rollout on that node come with it). A job whose deployment
   does not resolve runs without GPUs (``CUDA_VISIBLE_DEVICES=""``) and reports its own error; a job that
   needs more GPUs than the launcher has is marked failed, with that message, without running. The launcher's
   GPUs must be distinct (``CUDA_VISIBLE_DEVICES=0,0`` is refused before any job runs).
2. Jobs start in order as soon as their GPUs are free (a smaller job may go ahead of one that waits): the
   lowest free GPU ids are claimed (:mod:`.gpu_claims`, so concurrent launches on the machine keep apart too)
   and the job runs in a process forked from this one, with ``CUDA_VISIBLE_DEVICES`` set to its GPUs (the
   local backend indexes the plan's local GPU ids into it) and ports claimed as every launch claims them. A
   job that can never get its GPUs (lock files of the launcher's GPUs cannot be opened) is failed, saying so,
   instead of waiting; as it polls the launcher checks its claims and says when their lock files vanished.
3. When a job's process ends, its GPUs are given back and waiting jobs start; a failed job is a failed
   ``JobReturn`` (Hydra's sweeper then fails the multirun at its end, after every job ran). A job process that
   dies without a result (killed) is failed with its exit status, and ``job_status.json`` says so.

With the ray backend the GPUs are the Ray cluster's: the launcher only counts them (Ray places the engines and
keeps concurrent launches apart), and a job gets no ``CUDA_VISIBLE_DEVICES`` of its own.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from miles_sglang_plugin.backends.visible_gpus import (
    VISIBLE_DEVICES_ENV,
    gpu_list_problems,
    nvidia_smi_gpus,
    split_gpu_list,
)
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.masking import mask_overrides
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.sweeps.gpu_claims import GpuClaims, GpuLockDirError, default_gpu_lock_dir
from miles_sglang_plugin.sweeps.report_callback import error_text, write_job_status

log = logging.getLogger(__name__)

#: Bounds of the launcher's settings (reading is bounded).
MAX_GPUS = 4096
#: Set in each job's environment: the GPUs the launcher gave it (also with the ray backend, where
#: ``CUDA_VISIBLE_DEVICES`` is Ray's business).
PACKED_GPUS_ENV = "MSP_PACKED_GPUS"
#: How long jobs get to stop on Ctrl-C or SIGTERM before they are killed.
STOP_GRACE_S = 60.0
#: How long a job's process may take to exit once it sent its result.
EXIT_GRACE_S = 30.0


class PackedLaunchError(RuntimeError):
    """A job the launcher could not run (it needs more GPUs than it has)."""


def gpu_need(plan: DeploymentPlan) -> int:
    """GPUs a job needs on one machine: 1 + the highest local GPU id of the rollout's slots (engines,
    placeholders, eval), 0 without any. E.g. 4 colocated GPUs -> 4; rollout slots 4..7 after 4 training
    GPUs of the node -> 8; 20 rollout GPUs from slot 8 on nodes of 8 -> 8 (stand-ins side by side)."""
    slots = [
        plan.rollout_offset + group.gpu_offset + i
        for _model, group in plan.groups()
        for i in range(group.num_gpus)
    ]
    return 1 + max(slot % plan.num_gpus_per_node for slot in slots) if slots else 0


def rollout_gpus(plan: DeploymentPlan) -> int:
    return sum(group.num_gpus for _model, group in plan.groups())


@dataclass
class Job:
    index: int
    overrides: list[str]
    config: Any
    output_dir: Path
    need: int = 0
    #: Why the job cannot be sized (its deployment does not resolve): it runs without GPUs and says so itself.
    unsized: str | None = None
    backend: str = "local"
    ray_address: str | None = None
    gpus: list[str] = field(default_factory=list)
    process: Any = None
    conn: Connection | None = None
    started_at: float = 0.0
    result: Any = None


# --------------------------------------------------------------------------------------------------------
# Settings and GPUs


def _usage_error(messages: Sequence[str]) -> SystemExit:
    head = f"{len(messages)} problem{'s' if len(messages) != 1 else ''} with hydra.launcher (sglang_packed):"
    print("\n".join([f"error: {head}", *(f"  - {m}" for m in messages)]), file=sys.stderr)
    return SystemExit(2)


def discover_gpus() -> tuple[list[str], list[str]]:
    """This launcher's GPUs: its ``CUDA_VISIBLE_DEVICES`` (checked: distinct GPUs, see
    :func:`~miles_sglang_plugin.backends.visible_gpus.gpu_list_problems`), else those nvidia-smi lists, else
    none; and the problems of the variable."""
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if visible is not None:
        entries = list(split_gpu_list(visible))
        problems = gpu_list_problems(entries)
        shown = visible if len(visible) <= 60 else visible[:60] + "…"
        return entries, [f"gpus: the launcher's {VISIBLE_DEVICES_ENV}={shown!r} {p}" for p in problems]
    return list(nvidia_smi_gpus() or ())[:MAX_GPUS], []


def _explicit_gpus(value: Any) -> tuple[list[str] | None, list[str]]:
    """``hydra.launcher.gpus`` as a list of ids, or (None, problems)."""
    if isinstance(value, str):
        ids = list(split_gpu_list(value))
    elif isinstance(value, list | tuple) or type(value).__name__ == "ListConfig":
        ids = [str(g).strip() for g in value][: MAX_GPUS + 1]
    else:
        return None, [f"gpus: {value!r} must be null, a count or a list of GPU ids"]
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "…"
    if not ids or len(ids) > MAX_GPUS:
        return None, [f"gpus: {shown} must list 1..{MAX_GPUS} GPU ids"]
    problems = [f"gpus: {shown} {problem}" for problem in gpu_list_problems(ids)]
    return (ids, []) if not problems else (None, problems)


def gpus_of_setting(value: Any) -> tuple[list[str] | None, list[str]]:
    """The launcher's GPUs from ``hydra.launcher.gpus`` (see :class:`PackedLauncherConf`), or problems."""
    if value is None:
        found, problems = discover_gpus()
        if found or problems:
            return (None, problems) if problems else (found, [])
        return None, [
            "gpus: none found (no CUDA_VISIBLE_DEVICES, no nvidia-smi): set hydra.launcher.gpus=N, e.g. with "
            "stand-in engines (sglang_deploy=simulated)"
        ]
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= MAX_GPUS:
            return None, [f"gpus: {value} must be a count in 1..{MAX_GPUS}"]
        found, problems = discover_gpus()
        if problems:
            return None, problems
        if found and value > len(found):
            return None, [
                f"gpus: {value} GPUs asked for, but this machine shows {len(found)}: {','.join(found)}"
            ]
        return (found[:value] if found else [str(i) for i in range(value)]), []
    return _explicit_gpus(value)


def _check_numbers(settings: dict[str, Any]) -> list[str]:
    problems = []
    parallel = settings.get("max_parallel")
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
        problems.append(f"max_parallel: {parallel!r} must be null or an integer >= 1")
    poll = settings.get("poll_interval_s", 0.5)
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0.01 <= poll <= 60:
        problems.append(f"poll_interval_s: {poll!r} must be a number of seconds in 0.01..60")
    unknown = sorted(set(settings) - {"gpus", "max_parallel", "gpu_lock_dir", "poll_interval_s"})
    problems += [f"{k}: not a setting of the sglang_packed launcher" for k in unknown]
    return problems


@dataclass
class Settings:
    gpus: list[str]
    max_parallel: int | None
    lock_dir: Path
    poll_interval_s: float
    #: GPUs counted, not claimed (the ray backend: Ray assigns them).
    counted_only: bool = False


def read_settings(raw: dict[str, Any], backend: str, ray_address: str | None = None) -> Settings:
    """The launcher's checked settings; every problem in one message, exit 2, before any job runs."""
    problems = _check_numbers(raw)
    if backend == "ray":
        gpus, gpu_problems = _ray_gpus(raw.get("gpus"), ray_address)
    else:
        gpus, gpu_problems = gpus_of_setting(raw.get("gpus"))
    problems += gpu_problems
    lock_dir = Path(raw["gpu_lock_dir"]) if raw.get("gpu_lock_dir") else default_gpu_lock_dir()
    if not problems and backend != "ray":
        try:
            GpuClaims(lock_dir).check_usable()
        except GpuLockDirError as exc:
            problems.append(f"gpu_lock_dir: {exc}")
    if problems or gpus is None:
        raise _usage_error(problems)
    return Settings(
        gpus, raw.get("max_parallel"), lock_dir, float(raw.get("poll_interval_s", 0.5)), backend == "ray"
    )


def _ray_gpus(value: Any, address: str | None) -> tuple[list[str] | None, list[str]]:
    """With the ray backend the pool is a count of the cluster's GPUs: given, or asked of the cluster."""
    if value is None:
        count = _ray_cluster_gpus(address)
        if count is None:
            return None, ["gpus: no Ray cluster answered (set hydra.launcher.gpus to its GPU count)"]
    elif isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_GPUS:
        count = value
    else:
        return None, [f"gpus: {value!r} must be null or the Ray cluster's GPU count (1..{MAX_GPUS})"]
    return [f"ray-{i}" for i in range(count)], []


def _ray_cluster_gpus(address: str | None) -> int | None:
    """The GPUs of the Ray cluster the jobs use (``sglang_deploy.launch.ray.address``, else ``$RAY_ADDRESS``,
    else this machine's), asked from a short-lived process: this one forks the jobs, so it never connects to
    Ray itself."""
    import subprocess

    code = (
        "import os, sys, ray; ray.init(address=sys.argv[1] or os.environ.get('RAY_ADDRESS', 'auto'), "
        "logging_level='ERROR'); print(int(ray.cluster_resources().get('GPU', 0)))"
    )
    try:
        argv = [sys.executable, "-c", code, address or ""]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return (
        int(lines[-1])
        if out.returncode == 0 and lines and lines[-1].isdigit() and int(lines[-1]) > 0
        else None
    )


# --------------------------------------------------------------------------------------------------------
# Jobs


def _output_dir(config: Any) -> Path:
    """The job's output directory, as Hydra's run_job computes it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    HydraConfig.instance().set_config(config)
    return Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(
        OmegaConf.select(config, "hydra.sweep.subdir")
    )


def size_job(job: Job) -> None:
    """The job's GPU need and backend from its resolved plan (or why it has none)."""
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.reading import deploy_settings_from_config

    try:
        plan = resolve_config(job.config)
        launch = deploy_settings_from_config(job.config).launch
        job.backend, job.ray_address = str(launch.backend), launch.ray.address
    except Exception as exc:  # the job itself reports the same error when it runs
        job.unsized = error_text(exc)
        return
    job.need = rollout_gpus(plan) if job.backend == "ray" else gpu_need(plan)


def load_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Job]:
    from omegaconf import open_dict

    jobs = []
    for offset, overrides in enumerate(job_overrides):
        index = initial_job_idx + offset
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = index
            config.hydra.job.num = index
        job = Job(index, list(overrides), config, _output_dir(config))
        size_job(job)
        jobs.append(job)
    return jobs


class PackedJobFailed(CompactHydraException):
    """A job's failure as its process reported it (its exception's type and message; its traceback, if it
    has one worth showing, is in the job's log): Hydra shows the message alone at the multirun's end."""


def _failed_return(job: Job, exc: BaseException) -> Any:
    from hydra.core.utils import JobReturn, JobStatus

    return JobReturn(
        overrides=job.overrides,
        cfg=job.config,
        working_dir=str(job.output_dir),
        task_name=str(job.config.hydra.job.name),
        status=JobStatus.FAILED,
        _return_value=exc,
    )


def _record_status(job: Job) -> None:
    """``job_status.json`` of a job that ended (the report reads it), from its JobReturn."""
    failed = job.result.status.name == "FAILED"
    exc = job.result._return_value if failed else None
    error = str(exc) if isinstance(exc, PackedJobFailed) else error_text(exc) if exc is not None else None
    write_job_status(job.output_dir, "FAILED" if failed else "COMPLETED", error)


def _portable(ret: Any) -> Any:
    """``ret`` made safe to send to the launcher (exceptions and return values may not pickle)."""
    import pickle

    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.FAILED:
        ret._return_value = PackedJobFailed(error_text(ret._return_value))
    try:
        pickle.dumps(ret)
    except Exception as exc:
        log.warning("the job's return value does not pickle (%s); the launcher gets None", error_text(exc))
        ret._return_value = None
    return ret


def _run_in_child(launcher: Any, job: Job) -> Any:
    from hydra.core.utils import run_job

    try:
        ret = run_job(
            hydra_context=launcher.hydra_context,
            task_function=launcher.task_function,
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: still a result for the launcher
        write_job_status(job.output_dir, "FAILED", error_text(exc))
        return _failed_return(job, exc)
    raised = getattr(ret, "_return_value", None)  # what the task raised, where it failed
    if isinstance(raised, DeploymentConfigError):  # bad input: its message says it all
        log.error("job #%d failed: %s: %s", job.index, type(raised).__name__, raised)
    elif raised is not None and ret.status.name == "FAILED":
        trace = "".join(traceback.format_exception(raised))
        log.error("job #%d failed:\n%s", job.index, trace.rstrip())
    return ret


def _job_main(launcher: Any, job: Job, claims: GpuClaims, conn: Connection, counted_only: bool) -> None:
    """The job's process (forked): its own process group (the launcher forwards signals to it), the
    launcher's other claims closed, its GPUs in its environment, then Hydra's run_job."""
    os.setpgid(0, 0)
    claims.forget_in_child(job.gpus)
    _die_with_parent()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    if not counted_only:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(job.gpus)
    os.environ[PACKED_GPUS_ENV] = ",".join(job.gpus)
    ret = _run_in_child(launcher, job)
    with contextlib.suppress(Exception):
        from miles_sglang_plugin.serving.deployment import stop_all_active

        stop_all_active()  # a deployment the job left running (the sglang_cleanup safety net)
    conn.send(_portable(ret))
    conn.close()


def _die_with_parent() -> None:
    """SIGTERM to the job when the launcher dies (the job then stops its engines)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class _StopSignals:
    """SIGINT and SIGTERM while jobs run: recorded (the handler only notes it), acted on by the loop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Scheduler:
    """Starts jobs as their GPUs come free, collects them as they end."""

    def __init__(self, launcher: Any, jobs: list[Job], settings: Settings) -> None:
        self.launcher, self.settings = launcher, settings
        self.pending = [j for j in jobs if j.result is None]
        self.running: list[Job] = []
        self.claims = GpuClaims(settings.lock_dir)
        self.counted: set[str] = set()  # the ray backend's GPUs in use (counted, not locked)
        self.waiting_logged: set[int] = set()
        self.unreachable_logged = False

    def run(self) -> None:
        with _StopSignals() as stop:
            try:
                while self.pending or self.running:
                    if stop.signum is not None:
                        self._stop_all(stop.signum)
                        raise (
                            KeyboardInterrupt
                            if stop.signum == signal.SIGINT
                            else SystemExit(128 + stop.signum)
                        )
                    self._check_claims()
                    self._start_fitting()
                    self._collect(self.settings.poll_interval_s)
            finally:
                self.claims.release_all()

    def _take(self, job: Job) -> list[str] | None:
        if job.need == 0:
            return []
        if self.settings.counted_only:
            free = [g for g in self.settings.gpus if g not in self.counted]
            taken = free[: job.need] if len(free) >= job.need else None
            self.counted.update(taken or ())
            return taken
        free = [g for g in self.settings.gpus if g not in self.claims.fds]
        return self.claims.claim(free, job.need)

    def _give_back(self, job: Job) -> None:
        self.counted.difference_update(job.gpus)
        if not self.settings.counted_only:
            self.claims.release(job.gpus)

    def _start_fitting(self) -> None:
        for job in list(self.pending):
            if self.settings.max_parallel is not None and len(self.running) >= self.settings.max_parallel:
                return
            gpus = self._take(job)
            if gpus is None:
                never = self._never_fits(job)
                if never is not None:
                    self._fail_unrunnable(job, never)
                elif job.index not in self.waiting_logged and not self.running:
                    log.info(
                        "#%d waits for %d free GPUs (%s held by other launches)",
                        job.index,
                        job.need,
                        _gpu_list(self.claims.held_elsewhere) or "GPUs",
                    )
                    self.waiting_logged.add(job.index)
                continue
            job.gpus = gpus
            self.pending.remove(job)
            self._fork(job)

    def _never_fits(self, job: Job) -> str | None:
        """Why ``job`` can never get its GPUs here (lock files of the launcher's GPUs that cannot be opened),
        or None while it only waits (other launches hold GPUs)."""
        if self.settings.counted_only:
            return None
        unusable = {g: e for g, e in self.claims.unusable_gpus.items() if g in self.settings.gpus}
        claimable = len(self.settings.gpus) - len(unusable)
        if claimable >= job.need:
            return None
        reasons = "; ".join(
            f"GPU {gpu}: {self.claims.lock_dir / self.claims.lock_file_name(gpu)}: {exc.strerror or exc}"
            for gpu, exc in list(unusable.items())[:3]
        )
        more = f" (and {len(unusable) - 3} more)" if len(unusable) > 3 else ""
        return (
            f"job #{job.index} needs {job.need} GPUs, but only {claimable} of the launcher's "
            f"{len(self.settings.gpus)} can be claimed: their lock files cannot be opened ({reasons}{more}): it "
            "cannot run"
        )

    def _fail_unrunnable(self, job: Job, message: str) -> None:
        from hydra.core.utils import configure_log

        log.error(message)
        self.pending.remove(job)
        job.result = _refuse(self.launcher, job, message)
        _record_status(job)
        configure_log(self.launcher.config.hydra.hydra_logging, self.launcher.config.hydra.verbose)

    def _check_claims(self) -> None:
        """Say when the held GPUs' lock files vanished (the lock directory removed or replaced): made again, or
        lost to another launch; the guards keep the GPUs claimed meanwhile (see :mod:`.gpu_claims`)."""
        if self.settings.counted_only or not self.claims.fds:
            return
        check = self.claims.verify()
        where = self.claims.lock_dir
        if check.remade:
            log.warning(
                "the GPU lock directory %s was removed or replaced while this launch held GPUs %s (%s): their "
                "lock files are made again; no launch sharing the directory could take them meanwhile",
                where,
                _gpu_list(check.remade),
                self._holders(check.remade),
            )
        for gpu in check.lost:
            log.error(
                "GPU %s: claim lost: its lock file in %s vanished and another launch holds the new one (a "
                "launch that does not share this one's claim guards, e.g. in another network namespace); "
                "%s may share the GPU with it",
                gpu,
                where,
                self._holders([gpu]),
            )
        if check.unreachable is not None and not self.unreachable_logged:
            self.unreachable_logged = True
            log.error(
                "the GPU lock directory %s was removed or replaced and cannot be used now (%s): GPUs %s stay "
                "claimed by this launch's guards, but new claims fail until it is usable again",
                where,
                check.unreachable,
                _gpu_list(list(self.claims.fds)),
            )

    def _holders(self, gpus: Sequence[str]) -> str:
        jobs = [f"job #{j.index}" for j in self.running if set(j.gpus) & set(gpus)]
        return ", ".join(jobs) or "no running job"

    def _fork(self, job: Job) -> None:
        context = multiprocessing.get_context("fork")
        receiver, sender = context.Pipe(duplex=False)
        args = (self.launcher, job, self.claims, sender, self.settings.counted_only)
        job.process = context.Process(target=_job_main, args=args, name=f"sglang-packed-job-{job.index}")
        job.process.start()
        sender.close()
        job.conn, job.started_at = receiver, time.monotonic()
        self.running.append(job)
        where = ",".join(job.gpus) if job.gpus else "no GPUs"
        note = f" (its deployment does not resolve: {job.unsized})" if job.unsized else ""
        log.info("#%d started on %s (pid %d)%s", job.index, where, job.process.pid, note)

    def _collect(self, timeout: float) -> None:
        if not self.running:
            time.sleep(timeout)  # every pending job waits for GPUs another launch holds
            return
        ready = wait([j.conn for j in self.running if j.conn is not None], timeout=timeout)
        for job in [j for j in self.running if j.conn in ready]:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        assert job.conn is not None
        try:
            job.result = job.conn.recv()
        except (EOFError, OSError):
            job.result = None
        job.conn.close()
        job.process.join(timeout=EXIT_GRACE_S)
        if job.process.is_alive():  # it reported but does not exit (a thread that never ends): kill it
            log.warning(
                "#%d reported its result but did not exit within %g s: killed", job.index, EXIT_GRACE_S
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.process.pid, signal.SIGKILL)
            job.process.join()
        if job.result is None:
            code = job.process.exitcode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            job.result = _failed_return(
                job, PackedJobFailed(f"the job's process {why} before it reported a result")
            )
        _record_status(job)
        self.running.remove(job)
        self._give_back(job)
        status = job.result.status.name.lower()
        log.info(
            "#%d %s after %.1f s; GPUs %s free",
            job.index,
            status,
            time.monotonic() - job.started_at,
            ",".join(job.gpus) or "-",
        )

    def _stop_all(self, signum: int) -> None:
        """Forward the signal to every running job, wait for them (bounded), kill what is left."""
        log.warning(
            "%s: stopping %d running job(s); %d not started",
            signal.Signals(signum).name,
            len(self.running),
            len(self.pending),
        )
        for job in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.process.pid, signum)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.running and time.monotonic() < deadline:
            self._collect(0.2)
        for job in list(self.running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.process.pid, signal.SIGKILL)
            self._finish(job)


def _gpu_list(gpus: Sequence[str]) -> str:
    return ",".join(gpus[:16]) + (f",… ({len(gpus)} GPUs)" if len(gpus) > 16 else "")


# --------------------------------------------------------------------------------------------------------
# The launcher


def _refuse(launcher: Any, job: Job, message: str) -> Any:
    """Run ``job`` through Hydra with a task that fails with ``message``: its directory, config and the
    callbacks' job-end records are there as for any failed job."""
    from hydra.core.utils import run_job

    def refused(_cfg: Any) -> None:
        raise PackedLaunchError(message)

    ret = run_job(
        hydra_context=launcher.hydra_context,
        task_function=refused,
        config=job.config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    return _portable(ret)


def _backend(jobs: Sequence[Job]) -> str:
    backends = sorted({job.backend for job in jobs if job.unsized is None})
    if len(backends) > 1:
        raise _usage_error(
            [f"the sweep's jobs use several backends ({', '.join(backends)}): sweep one at a time"]
        )
    return backends[0] if backends else "local"


def _refuse_oversized(launcher: Any, jobs: Sequence[Job], settings: Settings) -> None:
    from hydra.core.utils import configure_log

    for job in jobs:
        if job.need > len(settings.gpus):
            where = "the Ray cluster has" if settings.counted_only else "the launcher has"
            message = (
                f"job #{job.index} needs {job.need} GPUs for its deployment, but {where} {len(settings.gpus)} "
                f"(hydra.launcher.gpus): it cannot run"
            )
            log.error(message)
            job.result = _refuse(launcher, job, message)
            _record_status(job)
            configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
    """The launcher's ``launch``: size every job, then run them packed; their JobReturns in job order."""
    from hydra.core.utils import configure_log, filter_overrides, setup_globals

    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    jobs = load_jobs(launcher, job_overrides, initial_job_idx)
    address = next((job.ray_address for job in jobs if job.ray_address), None)
    settings = read_settings(dict(launcher.settings), _backend(jobs), address)
    log.info(
        "Launching %d jobs packed on %d GPUs (%s)", len(jobs), len(settings.gpus), ",".join(settings.gpus)
    )
    for job in jobs:
        need = f"needs {job.need} GPUs" if job.unsized is None else "its deployment does not resolve"
        log.info(
            "\t#%d : %s (%s)", job.index, " ".join(mask_overrides(filter_overrides(job.overrides))), need
        )
    _refuse_oversized(launcher, jobs, settings)
    Scheduler(launcher, jobs, settings).run()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    for job in jobs:  # Hydra prints a failed job's overrides as they are: only masked ones reach it
        if job.result is not None:
            job.result.overrides = mask_overrides(job.result.overrides or [])
    return [job.result for job in jobs]
