"""The built wheel works on its own: presets, Hydra plugin and CLI come from the installed wheel, not the checkout.

Steps: copy the source tree to a temporary directory and build a wheel there; check the wheel's file list; install
it (no dependencies, no index) into a fresh virtual environment; then, from a temporary directory, run a minimal
Hydra app that ships no copy of the presets, ``--info searchpath`` of that app, and ``miles-sglang plan --json``.

How the fresh venv gets hydra & co. without downloads, and without seeing the checkout
-----------------------------------------------------------------------------------------
``python -m venv --system-site-packages`` does not help: a venv created from inside a venv is based on the
*base* interpreter, so its "system" site-packages is the base Python's, which has no hydra. Instead the fresh
venv (created ``--without-pip``; the wheel is installed with this interpreter's pip via ``pip --python``) gets a
``.pth`` file that lists this interpreter's site-packages directories as plain path lines. ``site`` appends
such lines to ``sys.path`` but does *not* process the ``.pth`` files inside them, so the outer venv's editable
install hook (``__editable__.miles_sglang_plugin-*.pth``, which puts the repository root on ``sys.path`` in
setuptools' compat mode, or imports a finder in strict mode) never runs. The fresh venv's own site-packages
comes first on ``sys.path``, so its copy of the package wins even where the outer venv holds a regular install.
Every command runs with ``python -I`` (no ``PYTHONPATH``, no cwd or script directory on ``sys.path``, no user
site-packages) from a temporary working directory, and a probe asserts that the package, the plugin module and
the ``hydra_plugins`` namespace resolve inside the fresh venv and that the repository root is not on
``sys.path``. (Outer packages that need their own ``.pth`` processing would not work this way; hydra-core,
omegaconf, PyYAML and rich do not.)

Editable installs (issue 30): a copy of the checkout is installed with ``pip install -e`` in each of setuptools'
editable modes (default, strict, compat) into a fresh venv of the same kind, whose outer path line leads to a
directory of links to the outer site-packages without anything of this package's (see ``_is_this_package``);
the build runs without isolation, in that venv, so it needs no index either. A bare Hydra app must then find
the group, and an edit of the checkout must show without a new install.

The wheel is built from a copy of the tree so that the build's ``build/`` and ``*.egg-info`` directories never
land in the working tree (which other processes may be editing) and concurrent runs do not collide.
``--skip-dependency-check``: setuptools >= 70.1 builds wheels itself, so the ``wheel`` package in
``build-system.requires`` is not needed for a ``--no-isolation`` build and need not be installed; the test
checks the setuptools version itself.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Top-level entries of the repository that the wheel build does not need (and must not copy: .venv is large).
_TOP_LEVEL_SKIP = {
    ".git",
    ".venv",
    ".venv-real",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "build",
    "dist",
    "outputs",
    "multirun",
    ".whl",
    ".gl",
}

#: Files the wheel must contain (besides every preset of the repository's conf/sglang/).
REQUIRED_IN_WHEEL = (
    "miles_sglang_plugin/__init__.py",
    # PEP 561: type checkers of the package's users read its annotations.
    "miles_sglang_plugin/py.typed",
    "miles_sglang_plugin/conf/__init__.py",
    "miles_sglang_plugin/conf/miles_sglang.yaml",
    "miles_sglang_plugin/conf/sglang/pd_actor_ref.yaml",
    "miles_sglang_plugin/conf/sglang/default.yaml",
    "miles_sglang_plugin/data/sglang_server_args_fields.txt",
    # The cpu_sglang kind's shim: a data directory, not a package of the packages list.
    "miles_sglang_plugin/cpu_engine_shim/sitecustomize.py",
    "miles_sglang_plugin/cpu_engine_shim/sgl_kernel/__init__.py",
    "hydra_plugins/miles_sglang_plugin/__init__.py",
    "hydra_plugins/miles_sglang_plugin/miles_sglang_searchpath.py",
    "hydra_plugins/miles_sglang_plugin/sglang_sweeps.py",
    "miles_sglang_plugin/sweeps/conf.py",
)

#: A Hydra app of its own: ConfigStore primary config, no config directory, no copy of the presets.
APP = textwrap.dedent(
    """
    import json

    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(
        name="cfg",
        node={
            "defaults": ["_self_", {"sglang": "default"}],
            "hf_checkpoint": None,
            "rollout_num_gpus_per_engine": 1,
        },
    )


    @hydra.main(version_base=None, config_path=None, config_name="cfg")
    def main(cfg):
        print("CFG_JSON=" + json.dumps(OmegaConf.to_container(cfg, resolve=True)))


    if __name__ == "__main__":
        main()
    """
)

PROBE = textwrap.dedent(
    """
    import json, sys
    import hydra, hydra_plugins, miles_sglang_plugin
    import hydra_plugins.miles_sglang_plugin.miles_sglang_searchpath as plugin
    from miles_sglang_plugin.config.store import config_search_path
    print(json.dumps({
        "package": miles_sglang_plugin.__file__,
        "plugin": plugin.__file__,
        "hydra_plugins_path": list(hydra_plugins.__path__),
        "hydra": hydra.__file__,
        "sys_path": sys.path,
        "search_path": config_search_path(),
    }))
    """
)


def _copy_ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory).resolve() == REPO:
        skip |= {n for n in names if n in _TOP_LEVEL_SKIP}
    return skip


def _run(cmd: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


def _inside(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def _require_setuptools_build() -> None:
    """Skip unless this interpreter can build the package without an index (``--no-isolation``)."""
    # The version from the metadata: importing setuptools here would patch distutils in the test process.
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed (a --no-isolation build needs setuptools>=77)")
    if int(version.split(".")[0]) < 77:
        pytest.skip(f"setuptools>=77 is needed for a --no-isolation build, found {version}")
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in the test interpreter (needed to install the package)")


@dataclass(frozen=True)
class WheelBuild:
    wheel: Path
    #: What the build printed, stdout and stderr.
    output: str


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory: pytest.TempPathFactory) -> WheelBuild:
    if importlib.util.find_spec("build") is None:
        pytest.skip("the 'build' package is not installed (pip install -e '.[test]')")
    _require_setuptools_build()

    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_copy_ignore)
    outdir = tmp / "dist"
    proc = _run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(outdir),
            str(src),
        ],
        cwd=tmp,
        timeout=120,
    )
    wheels = sorted(outdir.glob("miles_sglang_plugin-*.whl"))
    assert len(wheels) == 1, wheels
    return WheelBuild(wheels[0], proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def built_wheel(wheel_build: WheelBuild) -> Path:
    return wheel_build.wheel


@pytest.fixture(scope="module")
def fresh_venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding only the wheel; the outer interpreter's site-packages are visible as plain paths."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in the test interpreter (needed to install the wheel)")
    venv = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent)
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "--no-cache-dir",
            str(built_wheel),
        ],
        cwd=venv.parent,
        timeout=120,
    )
    purelib = _run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=venv.parent,
    ).stdout.strip()
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(purelib) / "_outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))
    return venv


def _shadow_site(site_dirs: list[str], shadow: Path, hidden: Callable[[str], bool]) -> Path:
    """A directory of links to every entry of ``site_dirs`` whose name ``hidden`` does not pick (the first of
    each name): a venv that has it as a plain path line sees those packages and nothing else of the outer
    venv's (no ``.pth`` processing either)."""
    shadow.mkdir()
    for site_dir in site_dirs:
        for entry in Path(site_dir).iterdir():
            if not hidden(entry.name) and not (shadow / entry.name).exists():
                (shadow / entry.name).symlink_to(entry)
    return shadow


def _is_sglang(name: str) -> bool:
    """SGLang's package and its metadata: a venv without them has every dependency of the wheel and no SGLang
    (``import sglang`` fails and ``importlib.metadata`` finds no distribution; sglang-router stays: it is
    another distribution)."""
    return name == "sglang" or (name.startswith("sglang-") and name.endswith(".dist-info"))


def _is_this_package(name: str) -> bool:
    """Whatever the outer venv holds of this package, in any install mode: the package, its metadata, an
    editable install's hooks (``__editable__*``) and the ``hydra_plugins`` namespace its plugin lives in (a
    regular outer install would put a copy of the plugin there, which Hydra's scan would then find)."""
    normal = name.lower().replace("-", "_")
    return normal.startswith(("miles_sglang_plugin", "__editable__")) or name == "hydra_plugins"


@pytest.fixture(scope="module")
def venv_without_sglang(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like :func:`fresh_venv`, with SGLang hidden: the wheel installed on a machine that only plans."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in the test interpreter (needed to install the wheel)")
    root = tmp_path_factory.mktemp("venv-no-sglang")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--no-cache-dir", str(built_wheel)],
        cwd=root, timeout=120,
    )  # fmt: skip
    purelib = _run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
    ).stdout.strip()
    outer = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    shadow = _shadow_site(outer, root / "site-packages-without-sglang", _is_sglang)
    (Path(purelib) / "_outer_site_packages.pth").write_text(f"{shadow}\n")
    return venv


def test_wheel_contents(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as zf:
        names = set(zf.namelist())
    missing = [n for n in REQUIRED_IN_WHEEL if n not in names]
    assert not missing, f"missing from {built_wheel.name}: {missing}\ncontents: {sorted(names)}"
    # Every config file of the repository's conf/ (not only conf/sglang/: a new config group directory needs its
    # own entry in pyproject's packages and package-data, easy to forget).
    conf = REPO / "conf"
    configs = sorted(p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml"))
    assert "sglang/pd_actor_ref.yaml" in configs
    missing_configs = [c for c in configs if f"miles_sglang_plugin/conf/{c}" not in names]
    assert not missing_configs, f"configs of conf/ missing from the wheel: {missing_configs}"
    # Hydra's plugin namespace must stay a namespace package (Hydra: "Do NOT place an __init__.py file in
    # hydra_plugins"), or it would shadow every other Hydra plugin installed.
    assert "hydra_plugins/__init__.py" not in names
    # The repository's conf/ is shipped only as miles_sglang_plugin/conf, never as a top-level package.
    assert not any(n.startswith("conf/") for n in names)
    entry_points = configparser.ConfigParser()
    with zipfile.ZipFile(built_wheel) as zf:
        entry_points.read_string(
            zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        )
    assert entry_points["console_scripts"]["miles-sglang"] == "miles_sglang_plugin.cli:main"


def test_installed_wheel_is_what_runs(fresh_venv: Path, tmp_path: Path) -> None:
    python = fresh_venv / "bin" / "python"
    probe = json.loads(_run([str(python), "-I", "-c", PROBE], cwd=tmp_path).stdout)
    assert _inside(probe["package"], fresh_venv), probe
    assert _inside(probe["plugin"], fresh_venv), probe
    assert probe["search_path"] == "pkg://miles_sglang_plugin.conf"
    # The checkout leaks neither as a sys.path entry nor as a portion of the hydra_plugins namespace.
    assert not any(Path(p).resolve() == REPO for p in probe["sys_path"] if p), probe["sys_path"]
    assert all(_inside(p, fresh_venv) for p in probe["hydra_plugins_path"]), probe["hydra_plugins_path"]


def test_hydra_app_uses_presets_from_the_wheel(fresh_venv: Path, tmp_path: Path) -> None:
    python = str(fresh_venv / "bin" / "python")
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "app.py").write_text(APP)
    assert not list(app_dir.rglob("*.yaml")), "the app must ship no configs"

    proc = _run(
        [
            python,
            "-I",
            "app.py",
            "sglang=pd_actor_ref",
            "sglang.actor.decode.num_gpus=12",
            "sglang.actor.num_gpus_per_engine=4",
            "hf_checkpoint=/ckpt",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=app_dir,
    )
    # Hydra re-prints warnings raised while importing a plugin module ("[Hydra plugins scanner]").
    assert "plugins scanner" not in proc.stderr, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CFG_JSON="))
    cfg = json.loads(line[len("CFG_JSON=") :])
    sg = cfg["sglang"]
    assert sg["actor"]["decode"]["num_gpus"] == 12
    assert sg["actor"]["prefill"]["num_gpus"] == 8
    assert sg["ref"]["regular"]["num_gpus"] == 4
    assert sg["actor"]["model_path"] == "/ckpt"
    assert sg["ref"]["model_path"] == "/ckpt"
    # ${..num_gpus_per_engine} of the group resolved against the model-level value given on the command line,
    # the reference model's against the trainer's rollout_num_gpus_per_engine (msp.trainer).
    assert sg["actor"]["decode"]["num_gpus_per_engine"] == 4
    assert sg["ref"]["regular"]["num_gpus_per_engine"] == 1
    assert cfg["sglang_deploy"]["launch"]["engine"] == "sglang"

    info = _run([python, "-I", "app.py", "--info", "searchpath"], cwd=app_dir).stdout
    assert "pkg://miles_sglang_plugin.conf" in info, info
    assert str(REPO) not in info, info


def _engines(group: dict) -> int:
    return len(group["engines"])


def test_cli_plan_from_the_wheel(fresh_venv: Path, tmp_path: Path) -> None:
    python = str(fresh_venv / "bin" / "python")
    out = _run(
        [
            python,
            "-I",
            "-m",
            "miles_sglang_plugin",
            "plan",
            "--json",
            "sglang=pd_actor_ref",
            "sglang.actor.num_gpus_per_engine=4",
            "hf_checkpoint=/ckpt",
        ],
        cwd=tmp_path,
    ).stdout
    plan = json.loads(out)
    assert plan["rollout_offset"] == 8
    assert plan["total_gpus"] == 20
    actor, ref = plan["models"]["actor"], plan["models"]["ref"]
    assert actor["pd_disaggregation"] is True
    assert actor["model_path"] == "/ckpt" and actor["update_weights"] is True
    assert ref["update_weights"] is False
    prefill, decode, regular = actor["groups"]["prefill"], actor["groups"]["decode"], ref["groups"]["regular"]
    assert (prefill["gpu_offset"], _engines(prefill), prefill["num_gpus_per_engine"]) == (0, 2, 4)
    assert (decode["gpu_offset"], _engines(decode), decode["num_gpus_per_engine"]) == (8, 2, 4)
    assert (regular["gpu_offset"], _engines(regular), regular["num_gpus_per_engine"]) == (16, 4, 1)
    assert decode["engines"][0]["gpu_slots"] == [16, 17, 18, 19]

    # The console script of the wheel, with a Hydra override that resizes a group.
    script = fresh_venv / "bin" / "miles-sglang"
    assert script.exists()
    out = _run(
        [
            str(script),
            "plan",
            "--json",
            "sglang=pd_actor_ref",
            "sglang.actor.decode.num_gpus=12",
            "sglang.actor.num_gpus_per_engine=4",
            "hf_checkpoint=/ckpt",
        ],
        cwd=tmp_path,
    ).stdout
    plan = json.loads(out)
    decode, regular = plan["models"]["actor"]["groups"]["decode"], plan["models"]["ref"]["groups"]["regular"]
    assert (decode["gpu_offset"], _engines(decode)) == (8, 3)
    assert (regular["gpu_offset"], _engines(regular)) == (20, 4)
    assert plan["total_gpus"] == 24


def test_a_trainer_app_with_the_wheel_and_no_sglang(venv_without_sglang: Path, tmp_path: Path) -> None:
    """Issue 13: the wheel installed without SGLang; the trainer app of tests/trainer_app (nested group, its
    own presets and names) plans through its dry run and through ``miles-sglang plan -cp/-cn``, override keys
    checked against the field list shipped with the package, said so."""
    python = str(venv_without_sglang / "bin" / "python")
    probe = _run(
        [python, "-I", "-c", "import importlib.util as u; print(u.find_spec('sglang'))"], cwd=tmp_path
    )
    assert probe.stdout.strip() == "None"
    app = tmp_path / "trainer_app"
    shutil.copytree(REPO / "tests" / "trainer_app", app, ignore=shutil.ignore_patterns("__pycache__"))
    proc = _run([python, "-I", "train.py", "hydra/callbacks=sglang_plan"], cwd=app)
    assert "32 GPUs in 1 model(s), 16 engine(s); rollout_offset=0" in proc.stdout
    assert (
        "override keys checked against SGLang 0.5.23 (field list shipped with miles_sglang_plugin)"
        in proc.stdout
    )
    out = _run(
        [python, "-I", "-m", "miles_sglang_plugin", "plan", "--json", "-cp", "config", "-cn", "ppo_trainer",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
        cwd=app,
    ).stdout  # fmt: skip
    plan = json.loads(out)
    assert (
        plan["server_args_checked_against"] == "SGLang 0.5.23 (field list shipped with miles_sglang_plugin)"
    )
    assert plan["models"]["actor"]["groups"]["decode"]["num_gpus_per_engine"] == 4
    typo = subprocess.run(
        [python, "-I", "train.py", "+actor_rollout_ref.rollout.engines.actor.decode.overrides.mem_fraction_statc=1"],
        cwd=app, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert typo.returncode == 2 and "did you mean mem_fraction_static?" in typo.stderr


def test_the_build_declares_every_directory_it_ships(wheel_build: WheelBuild) -> None:
    """Issue 31: a directory whose files are shipped but which is not in pyproject's packages list makes
    setuptools print a screenful per directory ("Package ... is absent from the `packages` configuration",
    "Package would be ignored"), at every install too (the cpu_sglang shim and its sgl_kernel were two)."""
    assert "would be ignored" not in wheel_build.output, wheel_build.output
    assert "absent from the `packages` configuration" not in wheel_build.output, wheel_build.output


#: ``pip install -e`` in each of setuptools' editable modes (PEP 660 installs): its default (called "lenient": a
#: meta path finder, plus a path hook for namespace packages), "strict" (a tree of links under the checkout's
#: build/ on sys.path) and "compat" (the checkout's root on sys.path).
EDITABLE_MODES = {
    "default": [],
    "strict": ["--config-settings", "editable_mode=strict"],
    "compat": ["--config-settings", "editable_mode=compat"],
}


@dataclass(frozen=True)
class EditableInstall:
    checkout: Path
    venv: Path
    #: What pip and the build printed, stdout and stderr.
    output: str


@pytest.fixture(scope="module", params=sorted(EDITABLE_MODES))
def editable_install(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> EditableInstall:
    """A copy of the checkout (the strict mode writes under its build/), installed editable into a new venv that
    sees the outer venv's packages but none of this package's (see :func:`_is_this_package`)."""
    _require_setuptools_build()
    root = tmp_path_factory.mktemp(f"editable-{request.param}")
    checkout = root / "checkout"
    shutil.copytree(REPO, checkout, ignore=_copy_ignore)
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
    ).stdout.strip()
    outer = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    # Before the install: without build isolation, the build runs in the new venv and takes setuptools from it.
    shadow = _shadow_site(outer, root / "site-packages-without-this-package", _is_this_package)
    (Path(purelib) / "_outer_site_packages.pth").write_text(f"{shadow}\n")
    proc = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--no-cache-dir", "-e", str(checkout),
         *EDITABLE_MODES[request.param]],
        cwd=root, timeout=120,
    )  # fmt: skip
    return EditableInstall(checkout, venv, proc.stdout + proc.stderr)


EDITABLE_PROBE = textwrap.dedent(
    """
    import json, pkgutil
    import hydra_plugins, miles_sglang_plugin
    print(json.dumps({
        "package": miles_sglang_plugin.__file__,
        "scanned": [m.name for m in pkgutil.iter_modules(hydra_plugins.__path__)],
    }))
    """
)


def test_an_editable_install_gives_every_hydra_app_the_group(
    editable_install: EditableInstall, tmp_path: Path
) -> None:
    """Issue 30: in every editable mode a bare Hydra app composes the group's presets, and an edit of the
    checkout shows without reinstalling. The default mode used to hide the plugin from Hydra's scan (the
    ``hydra_plugins`` namespace's only portion was the finder's placeholder, which lists no modules): every app
    failed with ``Could not find 'sglang/pd_actor_ref'`` (Hydra issue #2359)."""
    python = str(editable_install.venv / "bin" / "python")
    probe = json.loads(_run([python, "-I", "-c", EDITABLE_PROBE], cwd=tmp_path).stdout)
    # The checkout's code (in the strict mode through links under the checkout's build/), not a copy in the venv.
    assert _inside(probe["package"], editable_install.checkout), probe
    # What Hydra's plugin scan lists: pkgutil over the namespace's portions.
    assert probe["scanned"] == ["miles_sglang_plugin"], probe

    # The preset as the checkout has it (8 prefill GPUs), changed after the install: 6.
    preset = editable_install.checkout / "conf" / "sglang" / "pd_actor_ref.yaml"
    before = "  prefill:\n    num_gpus: 8\n"
    assert before in preset.read_text()
    preset.write_text(preset.read_text().replace(before, "  prefill:\n    num_gpus: 6\n"))
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "app.py").write_text(APP)
    proc = _run(
        [python, "-I", "app.py", "sglang=pd_actor_ref", "sglang.actor.decode.num_gpus=12", "hf_checkpoint=/ckpt",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=app_dir,
    )  # fmt: skip
    assert "plugins scanner" not in proc.stderr, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CFG_JSON="))
    sg = json.loads(line[len("CFG_JSON=") :])["sglang"]
    assert sg["actor"]["prefill"]["num_gpus"] == 6
    assert sg["actor"]["decode"]["num_gpus"] == 12
    assert sg["ref"]["regular"]["num_gpus"] == 4
    assert sg["actor"]["model_path"] == "/ckpt"
    # The install said nothing about directories left out of the packages list (see the wheel build's test).
    assert "would be ignored" not in editable_install.output, editable_install.output
