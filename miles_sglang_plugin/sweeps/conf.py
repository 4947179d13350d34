"""The sweeps' config nodes and their registration in Hydra's ConfigStore (done by the plugin module
``hydra_plugins/miles_sglang_plugin/sglang_sweeps.py`` at Hydra start-up: this module imports nothing heavy).

- ``sglang_bench``: ``default`` and ``smoke`` — the per-job rollout benchmark, at the root key ``sglang_bench``
  (``+sglang_bench=default``, or ``- sglang_bench: default`` in the app's defaults list);
- ``hydra/launcher``: ``sglang_packed`` — sweep jobs side by side on disjoint GPUs;
- ``hydra/callbacks``: ``sglang_sweep_report`` — the sweep's table and plot at multirun end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROVIDER = "miles_sglang_plugin"

#: Where Hydra finds the launcher class: its ``_target_`` must lie in the ``hydra_plugins`` package.
PACKED_LAUNCHER_TARGET = "hydra_plugins.miles_sglang_plugin.sglang_sweeps.PackedLauncher"
REPORT_CALLBACK_TARGET = "miles_sglang_plugin.sweeps.report_callback.SweepReportCallback"


@dataclass
class RolloutBenchConf:
    """A bounded rollout benchmark against each model's router: ``num_prompts`` requests of exactly
    ``input_len`` prompt tokens and ``output_len`` output tokens (``ignore_eos``), ``concurrency`` in flight."""

    num_prompts: int = 64
    concurrency: int = 8
    input_len: int = 128
    output_len: int = 32
    #: Models to measure, one after the other (empty: every model with engines, in deployment order).
    models: list[str] = field(default_factory=list)
    #: Streamed requests (the client sees the first token: TTFT even where the engine does not report it).
    stream: bool = True
    #: One request's deadline, and the whole benchmark's per model (requests left then count as errors).
    request_timeout_s: float = 120.0
    timeout_s: float = 900.0
    #: Seed of the prompts' token ids (ids in 1000..19999, valid for any common tokenizer).
    seed: int = 0


SMOKE_BENCH = RolloutBenchConf(num_prompts=8, concurrency=4, input_len=16, output_len=4)


@dataclass
class PackedLauncherConf:
    """``hydra/launcher=sglang_packed``: each job's GPU need from its resolved plan, jobs side by side on
    disjoint GPUs, each with its own ``CUDA_VISIBLE_DEVICES`` slice."""

    _target_: str = PACKED_LAUNCHER_TARGET
    #: The GPUs to pack jobs on: null = this launcher's ``CUDA_VISIBLE_DEVICES``, else the GPUs nvidia-smi
    #: lists; a count N = the first N of those (0..N-1 where none are found, e.g. with stand-in engines); or a
    #: list of ids (``[0,1,2,3]``, ``"4,5,6,7"``). With the ray backend: the Ray cluster's GPUs (null only).
    gpus: Any = None
    #: At most this many jobs at once (null: as many as fit).
    max_parallel: int | None = None
    #: Lock files of the GPU claims (null: ``$MSP_GPU_LOCK_DIR``, else ``<tmp>/miles-sglang-gpus-<uid>``):
    #: concurrent launches on one machine keep apart when they share it.
    gpu_lock_dir: str | None = None
    #: How often a waiting job retries GPUs another launch holds (seconds).
    poll_interval_s: float = 0.5


def _bench_default() -> type[RolloutBenchConf]:
    return RolloutBenchConf


def _bench_smoke() -> RolloutBenchConf:
    return SMOKE_BENCH


def _packed_launcher() -> type[PackedLauncherConf]:
    return PackedLauncherConf


def register_sweep_configs() -> None:
    """Store the sweeps' nodes (idempotent: ConfigStore replaces an entry stored again). The typed ones are
    stored unbuilt, built when Hydra first loads them (``LazyNode``): every Hydra app's plugin scan runs this,
    and building the three took about 5.5 ms there."""
    from hydra.core.config_store import ConfigStore

    from miles_sglang_plugin.config.store import store_lazily

    store = ConfigStore.instance()
    store_lazily("default", _bench_default, group="sglang_bench")
    store_lazily("smoke", _bench_smoke, group="sglang_bench")
    store_lazily("sglang_packed", _packed_launcher, group="hydra/launcher")
    store.store(
        group="hydra/callbacks",
        name="sglang_sweep_report",
        package="hydra.callbacks",
        node={"sglang_sweep_report": {"_target_": REPORT_CALLBACK_TARGET}},
        provider=PROVIDER,
    )
