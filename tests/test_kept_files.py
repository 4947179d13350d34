"""The guard of every file the package keeps between processes (``kept_files.py``): a file or folder of another
user, writable by others, a link (at the name, at the folder, at the temporary name), a hard link, a FIFO, an
oversized, truncated or altered file are each refused (noted, never followed, never waited on); a relative
``XDG_CACHE_HOME`` is ignored; a read-only or full file system and two writers at once leave whole files and
no temporary one."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin import kept_files
from miles_sglang_plugin.kept_files import KeptFolder, UnfitError

#: SHA-256 of b"hello" (a published test vector).
HELLO_SHA256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
HELLO_FILE = b"miles_sglang_plugin kept file, sha256 " + HELLO_SHA256.encode() + b"\nhello"


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KeptFolder]:
    """A kept folder of the test's own (``$XDG_CACHE_HOME/miles_sglang_plugin/things``); notes start afresh."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kept_files, "_noted", set())
    made = kept_files.cache_folder("things")
    assert made is not None
    yield made


def _tmp_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp"))


def test_a_kept_file_is_its_digest_line_then_its_content(folder: KeptFolder, tmp_path: Path) -> None:
    assert folder.path == tmp_path / "xdg" / "miles_sglang_plugin" / "things"
    assert kept_files.store(folder, "greeting", b"hello")
    path = folder.path / "greeting"
    assert path.read_bytes() == HELLO_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.stat().st_mode & 0o777 for p in (folder.path, folder.path.parent)] == [0o700, 0o700]
    assert kept_files.load(folder, "greeting", 5, "the greeting") == b"hello"
    assert kept_files.load(folder, "missing", 5, "the greeting") is None
    assert _tmp_files(folder.path) == []


def _another_users(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 4242, -1, follow_symlinks=False)


def _hard_link(path: Path) -> None:
    os.link(path, path.with_name("second-name"))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _link_to_elsewhere(path: Path) -> None:
    target = path.parent.parent / "elsewhere"
    path.rename(target)
    path.symlink_to(target)


def _folder_a_link(path: Path) -> None:
    moved = path.parent.with_name("moved")
    path.parent.rename(moved)
    path.parent.symlink_to(moved)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


#: How a kept file of b"hello" is spoilt, and the reason it is refused (the path written {path}).
SPOILT = {
    "another user's file": (_another_users, "{path} belongs to another user (uid 4242)"),
    "another user's folder": (
        lambda path: _another_users(path.parent.parent),
        "folder {path.parent.parent} belongs to another user (uid 4242)",
    ),
    "a file writable by the group": (
        lambda path: path.chmod(0o620),
        "{path} may be written by other users (mode 0620)",
    ),
    "a file writable by anyone": (
        lambda path: path.chmod(0o602),
        "{path} may be written by other users (mode 0602)",
    ),
    "a folder writable by the group": (
        lambda path: path.parent.chmod(0o770),
        "folder {path.parent} may be written by other users (mode 0770)",
    ),
    "the app folder writable by anyone": (
        lambda path: path.parent.parent.chmod(0o1777),
        "folder {path.parent.parent} may be written by other users (mode 1777)",
    ),
    "a link at the name": (_link_to_elsewhere, "{path} is a symbolic link"),
    "a link at the folder": (_folder_a_link, "{path.parent} is a symbolic link or not a folder"),
    "a hard link": (_hard_link, "{path} has 1 other hard link(s)"),
    "a FIFO": (_fifo, "{path} is not a regular file"),
    "truncated": (
        lambda path: path.write_bytes(HELLO_FILE[:-1]),
        "{path} does not match its digest (truncated or altered)",
    ),
    "one byte altered": (_flip_last_byte, "{path} does not match its digest (truncated or altered)"),
    "no digest line": (
        lambda path: path.write_bytes(b"hello"),
        "{path} has no digest line (not written by this version, or altered)",
    ),
    "oversized": (
        lambda path: path.write_bytes(HELLO_FILE + b"!"),
        "{path} is 109 bytes, more than a kept file of its kind may be",
    ),
}


@pytest.mark.parametrize("kind", list(SPOILT))
def test_a_spoilt_file_is_refused_saying_why_and_noted_once(
    folder: KeptFolder, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    spoil, why = SPOILT[kind]
    path = folder.path / "greeting"
    assert kept_files.store(folder, "greeting", b"hello")
    assert folder.read("greeting", 5) == b"hello"  # exactly the bound: read
    spoil(path)
    with pytest.raises(UnfitError) as refused:
        folder.read("greeting", 5)  # a FIFO: no wait for a writer either
    assert str(refused.value) == why.format(path=path)
    with caplog.at_level(logging.WARNING, logger="miles_sglang_plugin"):
        assert kept_files.load(folder, "greeting", 5, "the greeting") is None
        assert kept_files.load(folder, "greeting", 5, "the greeting") is None
    assert caplog.messages == [f"{why.format(path=path)}: ignored; the greeting is made again"]


def test_a_link_at_the_name_is_replaced_never_written_through(folder: KeptFolder, tmp_path: Path) -> None:
    victim = tmp_path / "victims-file"
    victim.write_text("the victim's own content\n")
    folder.path.mkdir(parents=True, mode=0o700)
    (folder.path / "greeting").symlink_to(victim)
    assert kept_files.store(folder, "greeting", b"hello")
    assert victim.read_text() == "the victim's own content\n"
    assert not (folder.path / "greeting").is_symlink()
    assert (folder.path / "greeting").read_bytes() == HELLO_FILE


def test_a_link_at_the_temporary_name_is_never_written_through(
    folder: KeptFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary name is random; one guessed and planted is skipped for a fresh one (created O_EXCL)."""
    victim = tmp_path / "victims-file"
    victim.write_text("the victim's own content\n")
    names = iter(["guessed0", "fresh001"])
    monkeypatch.setattr(kept_files.secrets, "token_hex", lambda nbytes: next(names))
    folder.path.mkdir(parents=True, mode=0o700)
    (folder.path / ".greeting.guessed0.tmp").symlink_to(victim)
    assert kept_files.store(folder, "greeting", b"hello")
    assert victim.read_text() == "the victim's own content\n"
    assert (folder.path / "greeting").read_bytes() == HELLO_FILE
    assert sorted(p.name for p in folder.path.iterdir()) == [".greeting.guessed0.tmp", "greeting"]


def test_the_temporary_names_are_not_predictable(folder: KeptFolder, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def record(src: Any, dst: Any, **kwargs: Any) -> None:
        seen.append(str(src))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(kept_files.os, "replace", record)
    for _ in range(3):
        kept_files.store(folder, "greeting", b"hello")
    assert len(set(seen)) == 3
    # 64 random bits each (16 hex digits), not the process id a planted link could be named after (a random
    # name may contain the pid's digits by chance: the whole middle part is checked, not a substring)
    middles = [name.removeprefix(".greeting.").removesuffix(".tmp") for name in seen]
    assert all(name.startswith(".greeting.") and name.endswith(".tmp") for name in seen)
    assert all(re.fullmatch(r"[0-9a-f]{16}", middle) and middle != str(os.getpid()) for middle in middles)


def test_a_relative_xdg_cache_home_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert kept_files.cache_base() == tmp_path / "home" / ".cache"
    folder = kept_files.cache_folder("things")
    assert folder is not None and kept_files.store(folder, "greeting", b"hello")
    assert (
        tmp_path / "home" / ".cache" / "miles_sglang_plugin" / "things" / "greeting"
    ).read_bytes() == HELLO_FILE
    assert not (tmp_path / "relative").exists()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "absolute"))
    assert kept_files.cache_base() == tmp_path / "absolute"


def test_a_read_only_file_system_writes_nothing_and_reads_what_is_there(
    folder: KeptFolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kept_files.store(folder, "greeting", b"hello")
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(kept_files.os, "open", read_only)
        assert not kept_files.store(folder, "greeting", b"other")
        assert not kept_files.store(folder, "new", b"other")
        assert kept_files.load(folder, "greeting", 5, "the greeting") == b"hello"
    assert sorted(p.name for p in folder.path.iterdir()) == ["greeting"]


def test_a_full_file_system_leaves_the_old_file_whole_and_no_temporary_file(
    folder: KeptFolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kept_files.store(folder, "greeting", b"hello")
    real_write = os.write
    written: list[int] = []

    def fills_up(fd: int, data: Any) -> int:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(real_write(fd, bytes(data[:10])))  # a short write, then the disk is full
        return written[-1]

    with monkeypatch.context() as patched:
        patched.setattr(kept_files.os, "write", fills_up)
        assert not kept_files.store(folder, "greeting", b"a longer greeting")
    assert written == [10]
    assert kept_files.load(folder, "greeting", 100, "the greeting") == b"hello"
    assert _tmp_files(folder.path) == []


def test_nothing_is_written_into_a_folder_that_is_refused(folder: KeptFolder) -> None:
    folder.path.mkdir(parents=True, mode=0o700)
    folder.path.chmod(0o777)
    assert not kept_files.store(folder, "greeting", b"hello")
    assert list(folder.path.iterdir()) == []


def test_a_file_in_the_way_of_the_folder_costs_only_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "xdg").write_text("a file where the cache folder would go\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = kept_files.cache_folder("things")
    assert not kept_files.store(folder, "greeting", b"hello")
    assert kept_files.load(folder, "greeting", 5, "the greeting") is None


def test_two_writers_at_once_leave_one_whole_file(folder: KeptFolder) -> None:
    payloads = [bytes([65 + i]) * (3000 + i) for i in range(2)]
    assert kept_files.store(folder, "shared", payloads[0])
    seen: list[bytes | None] = []
    failures: list[BaseException] = []

    def write(payload: bytes) -> None:
        try:
            for _ in range(150):
                assert kept_files.store(folder, "shared", payload)
        except BaseException as exc:
            failures.append(exc)

    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for writer in writers:
        writer.start()
    while any(writer.is_alive() for writer in writers):
        seen.append(folder.read("shared", 4000))  # raises if ever torn
    for writer in writers:
        writer.join()
    assert failures == []
    assert set(seen) <= set(payloads) and seen
    assert folder.read("shared", 4000) in payloads
    assert sorted(p.name for p in folder.path.iterdir()) == ["shared"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=300), where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_content_reads_back_and_any_flipped_bit_is_refused(
    folder: KeptFolder, payload: bytes, where: int, bit: int
) -> None:
    assert kept_files.store(folder, "any", payload)
    path = folder.path / "any"
    data = path.read_bytes()
    assert (
        data
        == b"miles_sglang_plugin kept file, sha256 "
        + hashlib.sha256(payload).hexdigest().encode()
        + b"\n"
        + payload
    )
    assert folder.read("any", 300) == payload
    spoilt = bytearray(data)
    spoilt[where % len(data)] ^= 1 << bit
    path.write_bytes(bytes(spoilt))
    with pytest.raises(UnfitError):
        folder.read("any", 300)
