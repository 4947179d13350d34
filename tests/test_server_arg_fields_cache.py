"""The kept ServerArgs field list (``rendering/server_arg_fields.py``) holds to the guard of kept files: a link
planted at the temporary name is not written through, a list planted by another user is not believed, a FIFO
at its name does not block, a relative ``XDG_CACHE_HOME`` is ignored. SGLang's import is stood in for by the
shipped list (SGLang 0.5.23's), counted."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_sglang_plugin import cli, kept_files
from miles_sglang_plugin.rendering import server_arg_fields, sglang_server_args
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields, shipped_server_arg_fields

#: Where the stand-in SGLang is installed (a made-up path: only its name of the kept file depends on it).
INSTALLED = ("0.5.23", "/site-packages")


@pytest.fixture
def imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A cache of the test's own, an SGLang 0.5.23 that is "installed" and whose imports are counted (one entry
    per import); the field list looked up afresh before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kept_files, "_noted", set())
    monkeypatch.setattr(server_arg_fields, "installed_sglang", lambda: INSTALLED)
    counted: list[int] = []

    def imported() -> frozenset[str]:
        counted.append(1)
        return shipped_server_arg_fields()

    monkeypatch.setattr(sglang_server_args, "server_args_fields", imported)
    known_server_arg_fields.cache_clear()
    yield counted
    known_server_arg_fields.cache_clear()


def _kept_file(tmp_path: Path) -> Path:
    """The kept list's path, made by a first lookup, then removed."""
    known_server_arg_fields()
    known_server_arg_fields.cache_clear()
    (path,) = (tmp_path / "xdg" / "miles_sglang_plugin").glob("sglang-0.5.23-*-server-args-fields.txt")
    path.unlink()
    return path


def test_the_list_is_kept_and_read_back_by_the_next_process(imports: list[int], tmp_path: Path) -> None:
    assert known_server_arg_fields().fields == shipped_server_arg_fields()
    known_server_arg_fields.cache_clear()  # as a new process
    known = known_server_arg_fields()
    assert (known.fields, known.source, imports) == (
        shipped_server_arg_fields(),
        "SGLang 0.5.23 (installed)",
        [1],
    )
    (path,) = (tmp_path / "xdg" / "miles_sglang_plugin").glob("*-server-args-fields.txt")
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_link_at_the_pid_named_temporary_file_is_not_written_through(
    imports: list[int], tmp_path: Path
) -> None:
    """The temporary name was ``<name>.<pid>.tmp``, known in advance: a link planted there had ``plan``
    overwrite the file it points to."""
    path = _kept_file(tmp_path)
    victim = tmp_path / "victims-notes.txt"
    victim.write_text("the victim's own notes\n")
    path.with_suffix(f".{os.getpid()}.tmp").symlink_to(victim)
    assert known_server_arg_fields().fields == shipped_server_arg_fields()
    assert victim.read_text() == "the victim's own notes\n"
    assert path.is_file() and not path.is_symlink()


def test_a_list_planted_by_another_user_is_not_believed(
    imports: list[int], tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = _kept_file(tmp_path)
    planted = sorted(shipped_server_arg_fields() - {"mem_fraction_static"})
    path.write_bytes(kept_files.framed(("\n".join(planted) + "\n").encode()))  # even with a right digest
    os.chown(path, 4242, -1)
    with caplog.at_level(logging.WARNING, logger="miles_sglang_plugin"):
        known = known_server_arg_fields()
    assert "mem_fraction_static" in known.fields and imports == [1, 1]  # made by _kept_file, then again
    assert f"{path} belongs to another user (uid 4242): ignored; the ServerArgs field list is made again" in (
        caplog.messages
    )
    code = cli.main(["plan", "hf_checkpoint=/c", "+sglang.actor.regular.overrides.mem_fraction_static=0.5"])
    assert code == 0, capsys.readouterr().err


def test_a_fifo_at_the_lists_name_does_not_block(imports: list[int], tmp_path: Path) -> None:
    path = _kept_file(tmp_path)
    os.mkfifo(path, 0o600)
    found: list[frozenset[str]] = []
    lookup = threading.Thread(target=lambda: found.append(known_server_arg_fields().fields), daemon=True)
    lookup.start()
    lookup.join(timeout=60)  # a generous wait for an event: it never comes when the FIFO is opened to read
    blocked = lookup.is_alive()
    if blocked:  # let the blocked reader go, so that nothing is left behind
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        lookup.join()
    assert not blocked
    assert found == [shipped_server_arg_fields()]
    assert path.is_file()  # the FIFO replaced by the list


def test_a_relative_xdg_cache_home_is_ignored(
    imports: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    known_server_arg_fields()
    assert not (tmp_path / "relative").exists()
    assert len(list((tmp_path / "home" / ".cache" / "miles_sglang_plugin").glob("*-fields.txt"))) == 1
