"""What a Hydra job calls to benchmark its deployment: settings from ``sglang_bench``, results in the job's
output directory with the job's overrides (the sweep parameters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.masking import mask_overrides
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.printable import escape_controls
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.sweeps.bench import (
    BenchSettings,
    metrics_document,
    run_rollout_bench,
    write_job_results,
)


def bench_settings_from_config(cfg: DictConfig, plan: DeploymentPlan | None = None) -> BenchSettings | None:
    """The checked ``sglang_bench`` settings of ``cfg`` (None where the app's config has none): call it before
    launching, so that a bad value stops the job before anything starts."""
    node = cfg.get("sglang_bench") if isinstance(cfg, DictConfig) else None
    if node is None:
        return None
    values = OmegaConf.to_container(node, resolve=True)
    if not isinstance(values, dict):
        raise DeploymentConfigError([Problem("sglang_bench", f"must be a mapping, got {values!r}")])
    return BenchSettings.from_mapping({str(key): value for key, value in values.items()}, plan)


def job_overrides() -> list[str]:
    """This Hydra job's overrides (``hydra.overrides.task``): in a multirun, its sweep parameters; secret values
    (an API key, an environment variable's value) masked."""
    from hydra.core.hydra_config import HydraConfig

    return mask_overrides(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def job_output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()


def bench_from_config(
    cfg: DictConfig,
    deployment: Deployment,
    *,
    output_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any] | None:
    """Run the ``sglang_bench`` benchmark against ``deployment`` and write ``plan.json`` and ``metrics.json``
    into the job's output directory (or ``output_dir``); the metrics document, None without ``sglang_bench``."""
    settings = bench_settings_from_config(cfg, deployment.prepared.plan)
    if settings is None:
        return None
    document = metrics_document(
        deployment, settings, run_rollout_bench(deployment, settings), job_overrides()
    )
    path = write_job_results(output_dir or job_output_dir(), deployment, document)
    if console is not None:
        print_bench(document, console)
        console.print(f"metrics: {path}")
    return document


def _fmt(stats: dict[str, float] | None, key: str) -> str:
    return "-" if not stats else f"{stats[key]:.3f}"


def print_bench(document: dict[str, Any], console: Console) -> None:
    settings = document["settings"]
    title = (
        f"rollout benchmark: {settings['num_prompts']} prompts x {settings['input_len']} -> "
        f"{settings['output_len']} tokens, concurrency {settings['concurrency']}"
        + (" (simulated: stand-in engines)" if document["simulated"] else "")
    )
    table = Table(title=title, title_justify="left")
    for col in ("model", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "lat p50", "lat p99", "errors"):
        table.add_column(col)
    for name, m in document["models"].items():
        table.add_row(
            Text(escape_controls(name)),
            f"{m['succeeded']}/{m['requests']}",
            f"{m['requests_per_s']:.2f}",
            f"{m['output_tokens_per_s']:.1f}",
            _fmt(m["ttft_s"], "p50"),
            _fmt(m["ttft_s"], "p99"),
            _fmt(m["latency_s"], "p50"),
            _fmt(m["latency_s"], "p99"),
            Text(escape_controls("; ".join(f"{e['count']}x {e['sample']}" for e in m["errors"])[:80] or "-")),
        )
    console.print(table)
