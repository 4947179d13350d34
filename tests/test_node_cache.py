"""The schema nodes' disk cache (``config/node_cache.py``): a node loaded from it is the node a build gives; a
second process builds none; a schema changed in memory (an edit imported or not) never gets the other's node;
a torn, altered (one byte), foreign, oversized, linked, hard-linked or writable-by-others file, or a cache
that cannot be found or written, each fall back to building, never to an error (the guard itself:
``test_kept_files.py``); ``MSP_SCHEMA_CACHE=0`` reads and writes nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from miles_sglang_plugin.config import node_cache
from miles_sglang_plugin.config.store import LazyNode, register_configs
from miles_sglang_plugin.sweeps.conf import register_sweep_configs

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache of the test's own (``$XDG_CACHE_HOME``): the folder the nodes go to."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(node_cache.CACHE_ENV, raising=False)
    yield tmp_path / "xdg" / "miles_sglang_plugin" / "schema-nodes"


def _stored_lazy_nodes() -> dict[str, LazyNode]:
    register_configs()
    register_sweep_configs()
    found: dict[str, LazyNode] = {}

    def walk(tree: dict[str, object]) -> None:
        for value in tree.values():
            if isinstance(value, dict):
                walk(value)
            elif isinstance(getattr(value, "node", None), LazyNode):
                lazy = value.node  # type: ignore[attr-defined]
                found[lazy.name] = lazy

    walk(ConfigStore.instance().repo)
    return found


def _fresh(lazy: LazyNode) -> LazyNode:
    return LazyNode(lazy.make, lazy.name)


def _same_node(a: DictConfig, b: DictConfig) -> bool:
    """Same values (interpolations unresolved), same types at every level, same struct flag."""
    return (
        OmegaConf.to_container(a, resolve=False) == OmegaConf.to_container(b, resolve=False)
        and OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b)
        and OmegaConf.get_type(a) is OmegaConf.get_type(b)
        and OmegaConf.is_struct(a) == OmegaConf.is_struct(b)
        and all(OmegaConf.get_type(a, key) == OmegaConf.get_type(b, key) for key in a)  # type: ignore[arg-type]
    )


def test_every_stored_node_loaded_from_the_cache_is_the_node_a_build_gives(cache_home: Path) -> None:
    nodes = _stored_lazy_nodes()
    assert {"sglang_model.base", "sglang_deploy.default", "sglang_deploy.simulated", "_root.miles_trainer_args",
            "sglang_group.decode", "sglang_trainer.verl", "sglang_bench.smoke",
            "hydra.launcher.sglang_packed"} <= set(nodes)  # fmt: skip
    for name, lazy in nodes.items():
        made = lazy.make()
        built = OmegaConf.structured(made)
        _fresh(lazy).node()  # builds and writes
        assert len(list(cache_home.glob(f"{name}-*.pickle"))) == 1, name
        cached = node_cache.load(name, made)
        assert cached is not None, name
        assert _same_node(cached[1], built), name
        assert _same_node(_fresh(lazy).node(), built), name  # a new LazyNode: from the cache
    # the two deploy settings differ only in an instance's value: two fingerprints, two files
    assert node_cache.fingerprint(nodes["sglang_deploy.default"].make()) != node_cache.fingerprint(
        nodes["sglang_deploy.simulated"].make()
    )


def _compose_in_a_new_process(env: dict[str, str]) -> tuple[int, str]:
    """(how many structured configs of the package's schemas the process built, the plan's JSON) for
    ``plan --json`` of pd_actor_ref."""
    count, plan_json, _ = _compose_in_a_new_process_with_stderr(env)
    return count, plan_json


def _compose_in_a_new_process_with_stderr(env: dict[str, str]) -> tuple[int, str, str]:
    """:func:`_compose_in_a_new_process`, and what the process wrote to stderr."""
    code = (
        "import io, sys, contextlib\n"
        "import omegaconf\n"
        "built = []\n"
        "real = omegaconf.OmegaConf.structured\n"
        "def counted(obj, *a, **k):\n"
        "    if getattr(obj, '__module__', '').startswith('miles_sglang_plugin.'):\n"
        "        built.append(obj)\n"
        "    return real(obj, *a, **k)\n"
        "omegaconf.OmegaConf.structured = staticmethod(counted)\n"
        "from miles_sglang_plugin.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    code = main(['plan', '--json', 'sglang=pd_actor_ref', 'hf_checkpoint=/c'])\n"
        "assert code == 0\n"
        "print(len(built)); print(out.getvalue(), end='')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr
    count, plan_json = done.stdout.split("\n", 1)
    return int(count), plan_json, done.stderr


def test_a_second_process_builds_no_node_and_plans_the_same(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(node_cache.CACHE_ENV, None)
    first_built, first = _compose_in_a_new_process(env)
    folder = tmp_path / "xdg" / "miles_sglang_plugin" / "schema-nodes"
    assert sorted(p.name.rsplit("-", 1)[0] for p in folder.iterdir()) == [
        "_root.miles_trainer_args", "sglang_deploy.default", "sglang_model.base",
    ]  # fmt: skip
    assert folder.stat().st_mode & 0o777 == 0o700
    second_built, second = _compose_in_a_new_process(env)
    off_built, off = _compose_in_a_new_process({**env, node_cache.CACHE_ENV: "0"})
    assert (first_built, second_built, off_built) == (3, 0, 3)
    assert first == second == off
    assert sorted(json.loads(second)["models"]) == ["actor", "ref"]  # a plan, not an empty answer


def test_a_node_with_one_byte_altered_is_built_again_not_served(tmp_path: Path) -> None:
    """A cached deploy node whose ``port_base`` 15000 became 15001 (one byte of its pickle: BININT2 0x3a98 ->
    0x3a99, little-endian) is refused by its digest: the router stays on 15000, the node is built again."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(node_cache.CACHE_ENV, None)
    assert _compose_in_a_new_process(env)[0] == 3
    folder = tmp_path / "xdg" / "miles_sglang_plugin" / "schema-nodes"
    (path,) = folder.glob("sglang_deploy.default-*.pickle")
    data = path.read_bytes()
    assert data.count(b"M\x98:") == 1  # pickle's BININT2 of 15000
    path.write_bytes(data.replace(b"M\x98:", b"M\x99:"))
    built, plan_json, err = _compose_in_a_new_process_with_stderr(env)
    router_url = json.loads(plan_json)["models"]["actor"]["router"]["url"]
    assert (built, router_url) == (1, "http://<driver address>:15000")
    assert f"{path} does not match its digest (truncated or altered): ignored" in " ".join(err.split())
    assert path.read_bytes() == data  # written anew, as it was before the flip
    assert _compose_in_a_new_process(env)[0] == 0


def test_the_cache_off_reads_and_writes_nothing(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lazy = _stored_lazy_nodes()["sglang_model.base"]
    _fresh(lazy).node()
    assert node_cache.load("sglang_model.base", lazy.make()) is not None
    monkeypatch.setenv(node_cache.CACHE_ENV, "0")
    assert node_cache.load("sglang_model.base", lazy.make()) is None
    for path in cache_home.iterdir():
        path.unlink()
    _fresh(lazy).node()
    assert list(cache_home.iterdir()) == []


class Color(StrEnum):
    red = "red"
    blue = "blue"


def _schema(**fields: tuple[Any, Any]) -> type:
    """A dataclass named ``Schema`` of this module with ``fields`` (name: (type, default)): the same class
    "edited" between calls, as a schema module is between two versions of it."""
    cls = dataclasses.make_dataclass(
        "Schema",
        [(name, kind, dataclasses.field(default=default)) for name, (kind, default) in fields.items()],
    )
    cls.__module__ = __name__
    return cls


@dataclasses.dataclass
class Inner:
    retries: int = 3


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    color: Color = Color.red


def test_the_fingerprint_follows_what_the_node_is_built_from() -> None:
    base = node_cache.fingerprint(_schema(port=(int, 1), name=(str, "a")))
    assert node_cache.fingerprint(_schema(port=(int, 1), name=(str, "a"))) == base  # the same definition
    edits = {
        "a default": _schema(port=(int, 2), name=(str, "a")),
        "a type": _schema(port=(float, 1), name=(str, "a")),
        "a field renamed": _schema(port=(int, 1), label=(str, "a")),
        "a field added": _schema(port=(int, 1), name=(str, "a"), extra=(bool, False)),
        "the order of fields": _schema(name=(str, "a"), port=(int, 1)),
    }
    prints = {what: node_cache.fingerprint(cls) for what, cls in edits.items()}
    assert base not in prints.values() and len(set(prints.values())) == len(edits), prints
    # a nested dataclass's default, and an instance's values, count too
    assert node_cache.fingerprint(Outer) == node_cache.fingerprint(Outer())
    assert node_cache.fingerprint(Outer(inner=Inner(retries=4))) != node_cache.fingerprint(Outer)
    assert node_cache.fingerprint(Outer(color=Color.blue)) != node_cache.fingerprint(Outer)


def test_a_schema_edited_after_its_import_never_gets_the_other_versions_node(cache_home: Path) -> None:
    """A process that imported a schema before an edit stores what it built from its own version; the edited
    version, imported by the next process, finds nothing of it (and the other way round)."""
    old, new = _schema(max_restarts=(int, 3)), _schema(max_restarts=(int, 7))
    for version, restarts in ((old, 3), (new, 7)):  # (a stand-in for each's node: these classes don't pickle)
        node_cache.store("edited", version, pickle.dumps(OmegaConf.create({"max_restarts": restarts})))
    cached_old, cached_new = node_cache.load("edited", old), node_cache.load("edited", new)
    assert cached_old is not None and cached_old[1].max_restarts == 3
    assert cached_new is not None and cached_new[1].max_restarts == 7
    assert node_cache.load("edited", _schema(max_restarts=(int, 9))) is None


def test_only_the_newest_files_of_a_node_are_kept(cache_home: Path) -> None:
    versions = [_schema(port=(int, port)) for port in range(node_cache.KEEP_PER_NODE + 3)]
    for age, version in enumerate(versions):
        node_cache.store("kept", version, pickle.dumps(OmegaConf.create({"port": age})))
        newest = cache_home / f"kept-{node_cache.fingerprint(version)}.pickle"
        os.utime(newest, ns=(age * 10**9, age * 10**9))  # written one after another
    node_cache.store("other", versions[0], pickle.dumps(OmegaConf.create({"port": 0})))
    kept = [v for v in versions if node_cache.load("kept", v) is not None]
    assert kept == versions[3:]  # the 3 oldest went
    assert node_cache.load("other", versions[0]) is not None  # another node's files are its own


def _with_digest(payload: bytes) -> bytes:
    """A kept file's content: the digest line of ``payload``, then ``payload``."""
    return (
        b"miles_sglang_plugin kept file, sha256 "
        + hashlib.sha256(payload).hexdigest().encode()
        + b"\n"
        + payload
    )


def _plant(cache_home: Path, made: Any, payload: bytes) -> Path:
    """Write ``payload`` (with its digest) as the cached node "planted" built from ``made``."""
    node_cache.store("planted", made, pickle.dumps(OmegaConf.create({})))  # makes the folder and the file
    path = cache_home / f"planted-{node_cache.fingerprint(made)}.pickle"
    assert path.is_file()
    path.write_bytes(_with_digest(payload))
    return path


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))


def _link_file(path: Path) -> None:
    target = path.with_name("elsewhere.pickle")
    path.rename(target)
    path.symlink_to(target)


def _link_folder(path: Path) -> None:
    moved = path.parent.with_name("moved")
    path.parent.rename(moved)
    path.parent.symlink_to(moved)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _another_users(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 4242, -1)


#: Ways a planted cache file is made unfit to load.
SPOIL = {
    "torn": lambda path: path.write_bytes(path.read_bytes()[:50]),
    "not a DictConfig": lambda path: path.write_bytes(_with_digest(pickle.dumps({"model": "base"}))),
    "one byte altered": _flip_a_byte,
    "a hard link": lambda path: os.link(path, path.with_name("second-name")),
    "too large": lambda path: path.write_bytes(b"\x80" * (node_cache.MAX_NODE_BYTES + 1)),
    "writable by others": lambda path: path.chmod(0o666),
    "folder writable by the group": lambda path: path.parent.chmod(0o770),
    "a link": _link_file,
    "the folder a link": _link_folder,
    "a FIFO": _fifo,
    "another user's": _another_users,
}


@pytest.mark.parametrize("kind", list(SPOIL))
def test_a_file_unfit_to_load_is_built_again(cache_home: Path, kind: str) -> None:
    made = Outer
    built = OmegaConf.structured(made)
    path = _plant(cache_home, made, pickle.dumps(built))
    fit = node_cache.load("planted", made)
    assert fit is not None and _same_node(fit[1], built)  # fit as planted
    SPOIL[kind](path)
    assert node_cache.load("planted", made) is None  # a FIFO: no wait for a writer either
    assert _same_node(LazyNode(lambda: made, "planted").node(), built)  # built again, no error


def test_a_torn_file_is_written_over_by_the_next_build(cache_home: Path) -> None:
    path = _plant(cache_home, Outer, b"\x80\x05 torn")
    LazyNode(lambda: Outer, "planted").node()
    cached = node_cache.load("planted", Outer)
    assert cached is not None and _same_node(cached[1], OmegaConf.structured(Outer))
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in cache_home.iterdir() if p.name.endswith(".tmp")] == []


def test_a_write_that_fails_leaves_no_temporary_file(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    node_cache.store("first", Outer, pickle.dumps(OmegaConf.structured(Outer)))  # the folder exists
    monkeypatch.setattr(node_cache.os, "replace", refuse)
    node_cache.store("second", Outer, pickle.dumps(OmegaConf.structured(Outer)))  # no error
    assert sorted(p.name.rsplit("-", 1)[0] for p in cache_home.iterdir()) == ["first"]


@pytest.mark.parametrize("where", ["a file in the way", "no home"])
def test_a_cache_that_cannot_be_found_or_written_costs_only_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    if where == "a file in the way":
        blocker = tmp_path / "xdg"
        blocker.write_text("a file where the cache folder would go\n")
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    else:  # HOME unset and the uid in no passwd file, as in some containers
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

        def no_home() -> Path:
            raise RuntimeError("Could not determine home directory.")

        monkeypatch.setattr(Path, "home", staticmethod(no_home))
    lazy = _stored_lazy_nodes()["sglang_deploy.default"]
    node = _fresh(lazy).node()
    assert _same_node(node, OmegaConf.structured(lazy.make()))
    assert node_cache.load("sglang_deploy.default", lazy.make()) is None
