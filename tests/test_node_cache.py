"""The schema nodes' disk cache (``config/node_cache.py``): a node loaded from it is the node a build gives; a
second process builds none; changed sources, a torn, foreign, oversized or writable-by-others file, or an
unwritable cache each fall back to building, never to an error; ``MSP_SCHEMA_CACHE=0`` reads and writes nothing."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from miles_sglang_plugin.config import node_cache
from miles_sglang_plugin.config.store import LazyNode, register_configs

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache of the test's own (``$XDG_CACHE_HOME``), the folder lookup forgotten before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(node_cache.CACHE_ENV, raising=False)
    node_cache._cache_dir.cache_clear()
    yield tmp_path / "xdg" / "miles_sglang_plugin"
    node_cache._cache_dir.cache_clear()


def _stored_lazy_nodes() -> dict[str, LazyNode]:
    register_configs()
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
        and all(
            OmegaConf.get_type(a, key) == OmegaConf.get_type(b, key)  # type: ignore[arg-type]
            for key in a
        )
    )


def test_every_stored_node_loaded_from_the_cache_is_the_node_a_build_gives(cache_home: Path) -> None:
    nodes = _stored_lazy_nodes()
    assert {"sglang_model.base", "sglang_deploy.default", "_root.miles_trainer_args",
            "sglang_group.decode", "sglang_trainer.verl"} <= set(nodes)  # fmt: skip
    for name, lazy in nodes.items():
        built = OmegaConf.structured(lazy.make())
        _fresh(lazy).node()  # builds and writes
        assert cache_home.glob(f"schema-nodes-*/{name}.pickle"), name
        cached = node_cache.load(name)
        assert cached is not None, name
        assert _same_node(cached[1], built), name
        assert _same_node(_fresh(lazy).node(), built), name  # a new LazyNode: from the cache


def _compose_in_a_new_process(env: dict[str, str]) -> tuple[int, str]:
    """(how many structured configs of the package's schemas the process built, the plan's JSON) for
    ``plan --json`` of pd_actor_ref."""
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
    return int(count), plan_json


def test_a_second_process_builds_no_node_and_plans_the_same(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(node_cache.CACHE_ENV, None)
    first_built, first = _compose_in_a_new_process(env)
    folders = list((tmp_path / "xdg" / "miles_sglang_plugin").glob("schema-nodes-*"))
    assert len(folders) == 1
    assert sorted(p.name for p in folders[0].iterdir()) == [
        "_root.miles_trainer_args.pickle", "sglang_deploy.default.pickle", "sglang_model.base.pickle",
    ]  # fmt: skip
    second_built, second = _compose_in_a_new_process(env)
    off_built, off = _compose_in_a_new_process({**env, node_cache.CACHE_ENV: "0"})
    assert (first_built, second_built, off_built) == (3, 0, 3)
    assert first == second == off
    assert sorted(json.loads(second)["models"]) == ["actor", "ref"]  # a plan, not an empty answer


def test_the_cache_off_reads_and_writes_nothing(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node_cache.CACHE_ENV, "0")
    node_cache._cache_dir.cache_clear()
    lazy = _stored_lazy_nodes()["sglang_model.base"]
    _fresh(lazy).node()
    assert not cache_home.exists()
    assert node_cache.load("sglang_model.base") is None


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not a source\n")
    return package


def test_the_sources_digest_follows_every_py_file_and_nothing_else(tmp_path: Path) -> None:
    package = _package(tmp_path)
    before = node_cache._sources_digest(package)
    assert node_cache._sources_digest(package) == before
    (package / "notes.txt").write_text("changed, and not a source\n")
    (package / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0" * 10)
    (package / "__pycache__" / "c.py").write_text("z = 3\n")  # inside __pycache__: not a source
    assert node_cache._sources_digest(package) == before
    b = package / "sub" / "b.py"
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 1_000_000_000))
    touched = node_cache._sources_digest(package)
    assert touched != before
    (package / "sub" / "b.py").write_text("y = 22\n")  # another size
    assert node_cache._sources_digest(package) not in (before, touched)
    (package / "new.py").write_text("")
    assert len({before, touched, node_cache._sources_digest(package)}) == 3


def test_new_sources_replace_this_installs_folder_and_leave_other_installs(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other_install = cache_home / "schema-nodes-000000000000-aaaaaaaaaaaaaaaa"
    other_install.mkdir(parents=True, mode=0o700)
    digests = iter(["1111111111111111", "2222222222222222"])
    monkeypatch.setattr(node_cache, "_sources_digest", lambda package: next(digests))
    node_cache.store("n", pickle.dumps(OmegaConf.create({"a": 1})))
    old = node_cache._cache_dir()
    assert old is not None and old.name.endswith("-1111111111111111") and (old / "n.pickle").is_file()
    node_cache._cache_dir.cache_clear()  # a new process, after a source changed
    assert node_cache.load("n") is None
    node_cache.store("n", pickle.dumps(OmegaConf.create({"a": 2})))
    new = node_cache._cache_dir()
    assert new is not None and new.name.endswith("-2222222222222222")
    assert not old.exists() and other_install.is_dir()
    cached = node_cache.load("n")
    assert cached is not None and cached[1] == {"a": 2}


def _plant(cache_home: Path, data: bytes) -> Path:
    """Write ``data`` as the cached node "sglang_model.base" of the current sources."""
    node_cache.store("sglang_model.base", pickle.dumps(OmegaConf.create({})))  # makes the folder
    folder = node_cache._cache_dir()
    assert folder is not None and folder.parent == cache_home
    path = folder / "sglang_model.base.pickle"
    path.write_bytes(data)
    return path


def _spoil(kind: str, path: Path) -> None:
    if kind == "torn":
        path.write_bytes(path.read_bytes()[:50])
    elif kind == "not a DictConfig":
        path.write_bytes(pickle.dumps({"model": "base"}))
    elif kind == "too large":
        path.write_bytes(b"\x80" * (node_cache.MAX_NODE_BYTES + 1))
    elif kind == "writable by others":
        path.chmod(0o666)
    elif kind == "folder writable by the group":
        path.parent.chmod(0o770)
    elif kind == "a link":
        target = path.with_name("elsewhere.pickle")
        path.rename(target)
        path.symlink_to(target)
    elif kind == "another user's":
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 4242, -1)


@pytest.mark.parametrize(
    "kind",
    ["torn", "not a DictConfig", "too large", "writable by others", "folder writable by the group", "a link",
     "another user's"],
)  # fmt: skip
def test_a_file_unfit_to_load_is_built_again(cache_home: Path, kind: str) -> None:
    lazy = _stored_lazy_nodes()["sglang_model.base"]
    built = OmegaConf.structured(lazy.make())
    path = _plant(cache_home, pickle.dumps(built))
    assert node_cache.load("sglang_model.base") is not None  # fit as planted
    _spoil(kind, path)
    assert node_cache.load("sglang_model.base") is None
    assert _same_node(_fresh(lazy).node(), built)  # built again, no error


def test_a_torn_file_is_written_over_by_the_next_build(cache_home: Path) -> None:
    lazy = _stored_lazy_nodes()["sglang_model.base"]
    path = _plant(cache_home, b"\x80\x05 torn")
    _fresh(lazy).node()
    cached = node_cache.load("sglang_model.base")
    assert cached is not None and _same_node(cached[1], OmegaConf.structured(lazy.make()))
    assert path.stat().st_mode & 0o777 == 0o600


def test_an_unwritable_cache_costs_only_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "xdg"
    blocker.write_text("a file where the cache folder would go\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    node_cache._cache_dir.cache_clear()
    try:
        lazy = _stored_lazy_nodes()["sglang_deploy.default"]
        node = _fresh(lazy).node()
        assert _same_node(node, OmegaConf.structured(lazy.make()))
        assert node_cache.load("sglang_deploy.default") is None
    finally:
        node_cache._cache_dir.cache_clear()
    assert blocker.read_text().startswith("a file")
