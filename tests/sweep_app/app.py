"""A small Hydra app for the sweep tests: it launches its deployment (stand-ins), records what its process
and its engines were given, holds the deployment a moment (so that packed jobs overlap), optionally fails,
and runs the rollout benchmark when ``sglang_bench`` is set.

Each job writes ``job_record.json`` in its output directory: pid, its ``CUDA_VISIBLE_DEVICES`` and
``MSP_PACKED_GPUS``, start and end times (``time.time()``), and per engine the GPUs the plan gave it and the
``CUDA_VISIBLE_DEVICES`` and node the stand-in reports."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miles_sglang_plugin.app.hydra_edge import launch_from_config, resolve_config_or_exit
from miles_sglang_plugin.config.schema import MilesTrainerArgs
from miles_sglang_plugin.sweeps.jobs import bench_from_config, bench_settings_from_config


@dataclass
class SweepAppConf(MilesTrainerArgs):
    hold_s: float = 1.0
    fail_while_serving: bool = False


ConfigStore.instance().store(name="sweep_app_schema", node=SweepAppConf)


def _write(record: dict) -> None:
    out = Path(HydraConfig.get().runtime.output_dir) / "job_record.json"
    out.write_text(json.dumps(record, indent=2))


@hydra.main(version_base=None, config_path="conf", config_name="app")
def main(cfg: DictConfig) -> None:
    record = {
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "packed_gpus": os.environ.get("MSP_PACKED_GPUS"),
        "start": time.time(),
    }
    _write(record)
    plan = resolve_config_or_exit(cfg)
    bench = bench_settings_from_config(cfg, plan)
    with launch_from_config(cfg) as deployment:
        headers = deployment.auth_headers()
        infos = {
            e.id: httpx.get(e.url + "/server_info", headers=headers, timeout=10).json()
            for e in deployment.engines()
        }
        record["engines"] = [
            {
                "id": e.id,
                "plan_gpus": e.gpus,
                "reported": infos[e.id].get("cuda_visible_devices"),
                "node_id": infos[e.id].get("node_id"),
            }
            for e in deployment.engines()
        ]
        _write(record)
        time.sleep(cfg.hold_s)
        if cfg.fail_while_serving:
            raise RuntimeError("asked to fail while serving")
        if bench is not None:
            bench_from_config(cfg, deployment)
    record["end"] = time.time()
    _write(record)


if __name__ == "__main__":
    main()
