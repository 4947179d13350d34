"""Child processes that are always cleaned up: own process group, log file, parent-death signal.

Every engine and router is started with :class:`ManagedProcess`:

* in a new session (its own process group), so stopping it stops its children too, and a Ctrl-C in the
  terminal reaches the launcher only (which then stops everything in order);
* with Linux's ``PR_SET_PDEATHSIG`` = SIGKILL, so it dies with the launcher even if the launcher is
  SIGKILLed and cannot clean up (real SGLang engines arm the same signal in their own subprocesses). The
  kernel sends it when the *thread* that started the process exits: start a deployment from a thread that
  outlives it (the main thread, or the thread that runs the ``with`` block). The signal is armed at exec
  time, without Python in the child: the command runs under util-linux's ``setpriv --pdeathsig KILL`` and a
  one-line ``/bin/sh`` guard that kills the child if the launcher died before the signal was armed (its
  parent is no longer the launcher), then execs the command (same pid). With nothing to run between fork
  and exec, ``Popen`` uses ``vfork``: a fork of a large launcher with many threads copies its page tables
  and runs a Python callback in the child (about 8 ms a process, far more under load). Where ``setpriv``
  is missing or cannot arm the signal, the child arms it itself from a ``preexec_fn`` (a fork, as before);
* with stdout and stderr in one log file, whose tail goes into error messages.

Stopping sends SIGTERM to the whole group, waits up to a grace period, then SIGKILLs the group. Processes are
only ever signalled through the process group this module created, never by name.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import logging
import os
import queue
import select
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from miles_sglang_plugin.engine_env import NODE_ID_ENV, PACKAGE_ENV_NAMES
from miles_sglang_plugin.masking import mask_text, secret_values

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
#: Variables this package sets in a process's environment: their values are no secret of the user's.
SHOWN_ENV_NAMES: frozenset[str] = PACKAGE_ENV_NAMES | {NODE_ID_ENV}


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: parent-death signals are best effort only
        return None


#: Resolved once, here: the child must not dlopen between fork and exec (the launcher has threads).
_PRCTL = _load_prctl()


def _arm_parent_death_signal(parent_pid: int) -> None:  # runs in the child between fork and exec
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died between fork and prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


#: Runs in the child after ``setpriv`` armed the signal: a parent that is not the launcher (``$1``) means the
#: launcher died before that, and no signal will ever come; else the command replaces the shell.
PARENT_GUARD = '[ "$PPID" = "$1" ] || kill -KILL $$; shift; exec "$@"'
#: The shell of the guard (POSIX ``sh``; ``$PPID`` is the parent at its start).
GUARD_SHELL = "/bin/sh"


@functools.cache
def exec_time_guard() -> tuple[str, ...] | None:
    """The argv prefix that arms the parent-death signal at exec time (``setpriv --pdeathsig KILL -- sh -c
    GUARD``), or None where ``setpriv`` is missing or cannot arm it (asked once, by running it)."""
    setpriv = shutil.which("setpriv")
    if _PRCTL is None or setpriv is None or not os.access(GUARD_SHELL, os.X_OK):
        return None
    prefix = (setpriv, "--pdeathsig", "KILL", "--", GUARD_SHELL, "-c", PARENT_GUARD, "msp-guard")
    try:
        probe = subprocess.run(
            [*prefix, str(os.getpid()), GUARD_SHELL, "-c", "exit 0"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if probe.returncode == 0 else None


def _executable(program: str, env: Mapping[str, str]) -> str:
    """Where ``program`` is, found as ``Popen`` finds it (on the child's ``PATH`` unless it names a path);
    the ``OSError`` ``Popen`` raises for a command that cannot run, raised here, before anything starts."""
    on_path = os.sep not in program
    candidates = [os.path.join(d, program) for d in os.get_exec_path(env)] if on_path else [program]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    if os.sep in program and os.path.exists(program):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def spawn_options(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The argv and ``Popen`` options that start ``argv`` with the parent-death signal armed: under the
    exec-time guard where there is one (no ``preexec_fn``: ``vfork``), else with a ``preexec_fn``."""
    guard = exec_time_guard()
    if guard is None:
        return list(argv), {"preexec_fn": functools.partial(_arm_parent_death_signal, os.getpid())}
    return [*guard, str(os.getpid()), _executable(argv[0], env), *argv[1:]], {}


#: The most a log tail reads: the end of the file, whatever its size (or a device that never ends).
LOG_TAIL_BYTES = 64 * 1024


def log_tail(path: Path, lines: int = 20, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` written at or after byte offset ``start``, from at most
    :data:`LOG_TAIL_BYTES` at its end; "" for anything but a regular file (a log on ``/dev/full``)."""
    try:
        with path.open("rb") as log_file:
            if not stat.S_ISREG(os.fstat(log_file.fileno()).st_mode):
                return ""
            size = log_file.seek(0, os.SEEK_END)
            log_file.seek(max(start, size - LOG_TAIL_BYTES))
            text = log_file.read(LOG_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LogNotWritableError(OSError):
    """The log file of a process cannot be written (a full disk): the process would fail without a word."""


def _check_writable(log: BinaryIO, path: Path) -> None:
    """Write a line marking the start of a run to the log now, so that a full disk is told before the process
    starts (it would fail writing its first line, leaving an empty log)."""
    try:
        # Straight to the file (no buffer left to flush, and fail again, when the file is closed).
        os.write(
            log.fileno(), f"[miles_sglang_plugin] {time.strftime('%Y-%m-%d %H:%M:%S')} starting\n".encode()
        )
    except OSError as exc:
        raise LogNotWritableError(
            exc.errno, f"its log file {path} cannot be written ({exc.strerror})"
        ) from exc


@dataclass
class ManagedProcess:
    """A child process in its own process group, logging to ``log_path``."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    display_command: str = ""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0
    #: Size of the log file when this process started: its output is what follows (a reused log directory
    #: keeps earlier runs' lines, which must not show up in this run's error messages).
    log_offset: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            _check_writable(log, self.log_path)
            self.log_offset = log.seek(0, os.SEEK_END)  # what follows is this run's output
            env = {**os.environ, **self.env}
            argv, options = spawn_options(self.argv, env)
            self.popen = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                **options,
            )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return self.popen.poll() if self.popen else None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # the group id is the child's pid (new session)

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of this run's output, with the secrets the process was given masked."""
        secrets = secret_values(self.argv, self.env, shown=SHOWN_ENV_NAMES)
        return mask_text(log_tail(self.log_path, lines, start=self.log_offset), secrets)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leader_pid(process: ManagedProcess) -> int:
    """The pid of a started process, which is also its process group's id (it leads a new session)."""
    assert process.popen is not None, f"{process.name} was never started"
    return process.popen.pid


def _still_running(process: ManagedProcess) -> bool:
    """The process, or any member of its process group, is still there."""
    return process.running or _group_alive(_leader_pid(process))


def stop_processes(processes: Iterable[ManagedProcess], grace_s: float = 10.0) -> dict[str, int | None]:
    """SIGTERM every process group, wait up to ``grace_s`` for all of them, SIGKILL what is left, reap.
    Returns each process's exit code (None if it was never started)."""
    started = [process for process in processes if process.popen is not None]
    for process in started:
        if process.running:
            process.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := deadline - time.monotonic()) > 0 and any(_still_running(process) for process in started):
        leaderless = False
        for process in started:
            if not process.running and _group_alive(_leader_pid(process)):
                # The leader is gone but members of its group are not: keep asking them to stop.
                process.signal_group(signal.SIGTERM)
                leaderless = True
        _await_an_exit([p for p in started if p.running], min(left, MEMBER_POLL_S if leaderless else 0.5))
    killed = [process for process in started if _still_running(process)]
    for process in killed:
        process.signal_group(signal.SIGKILL)
    codes: dict[str, int | None] = {}
    for process in started:
        assert process.popen is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=5)
        codes[process.name] = process.popen.returncode
    # SIGKILL is delivered at once but a loaded machine takes a moment to end a group's other members: return
    # when they are gone too (bounded), so that nothing of a stopped process outlives the call.
    deadline = time.monotonic() + 2.0
    while any(_group_has_live_members(_leader_pid(p)) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.01)
    return codes


#: How often a group whose leader is gone is looked at while its other members are asked to stop.
MEMBER_POLL_S = 0.01


def _await_an_exit(leaders: Sequence[ManagedProcess], timeout_s: float) -> None:
    """Until one of ``leaders`` exits or ``timeout_s`` passes: woken at the exit by a pidfd per process where
    Linux has them (a stop returns as soon as the last process is gone), else polled every
    :data:`MEMBER_POLL_S`."""
    fds: list[int] = []
    try:
        for process in leaders:
            fds.append(os.pidfd_open(_leader_pid(process)))
    except (AttributeError, OSError):  # no pidfds here, or one is gone already: look again soon
        timeout_s = min(timeout_s, MEMBER_POLL_S)
    try:
        if not fds:
            time.sleep(max(0.0, min(timeout_s, MEMBER_POLL_S)))
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)))
    finally:
        for fd in fds:
            os.close(fd)


def _group_has_live_members(pgid: int) -> bool:
    """A process of group ``pgid`` is still running (zombies do not count: an orphan killed here may stay a
    zombie where PID 1 does not reap). Without ``/proc``: whether the group exists at all."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _group_alive(pgid)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class ExitWatcher:
    """Calls ``on_exit()`` once for each watched process when it exits, from one thread of its own: with a
    pidfd per process where Linux offers them (the exit is noticed at once, nothing is polled), else by
    polling every :data:`EXIT_POLL_S`. ``on_exit`` must be quick (it runs on the watcher's thread)."""

    def __init__(self, name: str = "msp-exits") -> None:
        self._name = name
        self._polled: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def _ensure_running(self) -> None:
        """Its selector, wake pipe and thread, made by the first watch (under the lock)."""
        if self._thread is not None:
            return
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def watch_pid(self, pid: int, exited: Callable[[], bool], on_exit: Callable[[], None]) -> None:
        """Watch process ``pid`` (a child of this process, not yet reaped); ``exited()`` tells whether it
        has exited, for when no pidfd can be had."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here (or the process is already reaped): poll it
            self.watch_polled(exited, on_exit)
            return
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._ensure_running()
            self._selector.register(fd, selectors.EVENT_READ, on_exit)
        self._wake()

    def watch(self, process: ManagedProcess, on_exit: Callable[[], None]) -> None:
        if process.popen is None:
            return
        self.watch_pid(process.popen.pid, lambda: process.exit_code() is not None, on_exit)

    def watch_polled(self, exited: Callable[[], bool], on_exit: Callable[[], None]) -> None:
        """Watch something that can only be asked (``exited()``), every :data:`EXIT_POLL_S`."""
        with self._lock:
            if self._closed:
                return
            self._ensure_running()
            self._polled.append((exited, on_exit))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"w")

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                polling = bool(self._polled)
            for key, _ in self._selector.select(timeout=EXIT_POLL_S if polling else None):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_read, 4096)
                    continue
                with self._lock:
                    self._selector.unregister(key.fd)
                os.close(key.fd)
                _call_quietly(key.data)
            self._poll_once()
        self._release()

    def _poll_once(self) -> None:
        with self._lock:
            watched = list(self._polled)
        gone = [(exited, on_exit) for exited, on_exit in watched if _asks_quietly(exited)]
        if gone:
            with self._lock:
                self._polled = [entry for entry in self._polled if entry not in gone]
            for _exited, on_exit in gone:
                _call_quietly(on_exit)

    def _release(self) -> None:
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    with contextlib.suppress(OSError):
                        os.close(key.fd)
            self._selector.close()
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Stop watching (nothing more is called); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._wake()
        if thread is not threading.current_thread():
            thread.join(timeout=5)


#: How often processes without a pidfd are asked whether they exited.
EXIT_POLL_S = 0.1


def _call_quietly(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a watcher outlives any callback's mistake
        logging.getLogger(__name__).exception("an exit callback raised")


def _asks_quietly(exited: Callable[[], bool]) -> bool:
    try:
        return exited()
    except Exception:
        logging.getLogger(__name__).exception("an exit check raised")
        return False


class Spawner:
    """The one long-lived thread that starts a deployment's processes (a child's parent-death signal fires
    when the *thread* that started it exits, see the module docstring). A daemon thread of its own, not a
    ``ThreadPoolExecutor``: the executors' threads are joined (and exit) at interpreter exit *before*
    ``atexit`` handlers run, which would kill every child before the deployment could stop it in order."""

    def __init__(self, name: str = "msp-spawn") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self, function: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Run ``function(*args, **kwargs)`` on the spawner thread; its future. ``RuntimeError`` once shut down."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the spawner is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((future, functools.partial(function, *args, **kwargs)))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, timeout_s: float = 30.0) -> None:
        """No more starts; with ``wait``, until what was submitted is done (at most ``timeout_s``). Call it once
        every process it started is stopped: the thread then ends."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if wait and thread is not threading.current_thread():
            thread.join(timeout_s)
