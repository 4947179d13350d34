"""The package's shape: the public API at the top, lazily loaded, and listed in the docs (docs/api.md); the stage layering
checked by import-linter (the contracts in pyproject.toml); functions short enough to read; the benchmarks
still run (smoke mode)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import miles_sglang_plugin

REPO = Path(__file__).resolve().parent.parent


def _documented_api_names() -> set[str]:
    """The names of the docs' Public API page's table (``docs/api.md``)."""
    text = (REPO / "docs" / "api.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "|---" not in line][1:]
    return {name for line in table for name in re.findall(r"`(\w+)`", line.split("|")[2])}


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    import importlib

    for name in miles_sglang_plugin.__all__:
        module = importlib.import_module(miles_sglang_plugin._EXPORTS[name])
        assert getattr(miles_sglang_plugin, name) is getattr(module, name), name
    assert sorted(miles_sglang_plugin.__all__) == sorted(miles_sglang_plugin._EXPORTS)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'LocalLauncher'"):
        miles_sglang_plugin.LocalLauncher  # noqa: B018 - the old name is gone, no compatibility shim


def test_the_docs_list_exactly_the_public_api() -> None:
    assert _documented_api_names() == set(miles_sglang_plugin.__all__)


def test_importing_the_package_loads_no_stage() -> None:
    """The Hydra plugin scan imports the package in every Hydra app: it must not pull in the stages."""
    code = (
        "import sys, miles_sglang_plugin; "
        "print(sorted(m for m in sys.modules if m.startswith('miles_sglang_plugin.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_layers_hold(tmp_path: Path) -> None:
    """import-linter's contracts (pyproject.toml): each stage imports only earlier ones."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


#: The longest a function of the package may be, from its ``def`` line to its last line (ruff's C901, configured
#: in pyproject.toml, bounds the complexity).
MAX_FUNCTION_LINES = 60


def _functions_longer_than(limit: int, source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function or method in ``source`` longer than ``limit`` lines."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def _function_source(name: str, body_lines: int, indent: str = "") -> str:
    lines = [f"{indent}def {name}():", *(f"{indent}    x{i} = {i}" for i in range(body_lines))]
    return "\n".join(lines) + "\n"


def test_function_length_counts_from_the_def_line_to_the_last_line() -> None:
    assert _functions_longer_than(60, _function_source("fits", 59)) == []  # def + 59 lines = 60
    method = "class C:\n" + _function_source("method", 60, indent="    ")  # def + 60 lines = 61
    assert _functions_longer_than(60, method) == [("method", 2, 61)]


def test_no_function_of_the_package_is_longer_than_60_lines() -> None:
    too_long = [
        f"{path.relative_to(REPO)}:{line} {name} ({length} lines)"
        for path in sorted((REPO / "miles_sglang_plugin").rglob("*.py"))
        for name, line, length in _functions_longer_than(MAX_FUNCTION_LINES, path.read_text())
    ]
    assert too_long == [], "split these functions into well-named pieces:\n" + "\n".join(too_long)


BENCHMARK_OUTPUT = {
    "bench_resolve.py": "(b)/(a):",
    "bench_launch.py": "(3) POST /generate req/s",
    "bench_control.py": "one killed: failed 0",
    "bench_elastic.py": "failed 0 (goal 0)",
    "bench_rollout_client.py": "client: failed 0 (goal 0;",
    "bench_rolling_update.py": "failed 0 (goal 0)",
    "bench_sweep.py": "(1) packed/sequential:",
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(BENCHMARK_OUTPUT))
def test_benchmark_smoke_run(script: str) -> None:
    """Each benchmark's --smoke mode: one quick repetition at the smallest sizes, so the scripts cannot rot."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert BENCHMARK_OUTPUT[script] in result.stdout, result.stdout[-3000:]


def test_every_test_the_mutation_script_names_exists() -> None:
    """scripts/mutation.sh runs by hand, not in CI: a test it names that was renamed would silently run none."""
    script = (REPO / "scripts" / "mutation.sh").read_text()
    named = sorted(set(re.findall(r"(tests/\w+\.py)(?:::(\w+))?", script)))
    assert len(named) > 10
    for path, test in named:
        assert (REPO / path).is_file(), path
        if test:
            assert re.search(rf"^(async )?def {test}\(", (REPO / path).read_text(), re.M), f"{path}::{test}"
