"""How much time the ``sglang`` group adds to a Hydra app: compose, resolve and plan output, side by side.

Measured in one run (see benchmarks/README.md):

(a) compose of a bare Hydra app: compose API, a trivial primary config with a few keys, one override;
(b) compose + resolve of a 1,024-GPU, 4-model deployment built from Hydra overrides
    (``compose_config`` + ``resolve_config``), also split into its two halves;
(c) ``resolve_deployment`` alone, on a prebuilt spec and trainer inputs;
(d) ``DeploymentPlan.to_json()`` of the resolved plan;
(e) wall time of the whole ``miles-sglang plan --json`` command in a subprocess vs ``python -c "import hydra"``
    and vs a bare Hydra app that composes once (and, where SGLang is installed, vs importing SGLang's ServerArgs, which the command does to check override
    keys);
(f) ``register_configs()``: the ConfigStore registration that the Hydra plugin module runs at start-up of every
    Hydra app (and that ``compose_config`` repeats on each call).

Each step is called once as a warm-up (its time is shown as "first call": imports, Hydra's one-off plugin scan),
then the timed repetitions run interleaved round-robin across the steps, so that load on the machine hits all
steps alike. Steps (a) and (b) include ``GlobalHydra`` clear + initialize, as a one-shot compose does.

    python benchmarks/bench_resolve.py [--runs 50] [--subprocess-runs 5] [--json]
    python benchmarks/bench_resolve.py --smoke    # one repetition of every step (run by the tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The benchmark deployment, 1,024 rollout GPUs in 4 models (one router each), 176 engines. The trainer has 16
#: nodes of 8 GPUs (rollout_offset 128), so every group starts on a node boundary and no engine straddles nodes.
#:   actor  PD: prefill 128 GPUs TP 4 (32 engines), decode 512 GPUs TP 8 (64 engines)
#:   ref    regular 128 GPUs TP 4 (32 engines)
#:   reward regular 128 GPUs TP 8 (16 engines)
#:   judge  regular 128 GPUs TP 4 (32 engines)
OVERRIDES: tuple[str, ...] = (
    "sglang=pd_actor_ref",
    "hf_checkpoint=/ckpt/actor",
    "actor_num_nodes=16",
    "num_nodes=144",
    "sglang.actor.prefill.num_gpus=128",
    "sglang.actor.prefill.num_gpus_per_engine=4",
    "sglang.actor.decode.num_gpus=512",
    "sglang.actor.decode.num_gpus_per_engine=8",
    "+sglang.actor.decode.overrides.mem_fraction_static=0.85",
    "sglang.ref.regular.num_gpus=128",
    "sglang.ref.num_gpus_per_engine=4",
    "+sglang_model@sglang.reward=base",
    "sglang.reward.model_path=/ckpt/reward",
    "sglang.reward.update_weights=false",
    "sglang.reward.regular.num_gpus=128",
    "sglang.reward.num_gpus_per_engine=8",
    "+sglang_model@sglang.judge=base",
    "sglang.judge.model_path=/ckpt/judge",
    "sglang.judge.update_weights=false",
    "sglang.judge.regular.num_gpus=128",
    "sglang.judge.regular.num_gpus_per_engine=4",
)
EXPECTED = {"total_gpus": 1024, "models": 4, "engines": 176}

#: The smallest real use: one preset, the checkpoint, nothing else.
SMALL_OVERRIDES: tuple[str, ...] = ("sglang=pd_actor_ref", "hf_checkpoint=/ckpt/actor")

A = "(a) bare Hydra compose"
B = "(b) compose + resolve, 1,024 GPUs"
B1 = "  (b1) compose_config, 1,024 GPUs"
B0 = "  (b1') compose_config, pd_actor_ref only"
B2 = "  (b2) resolve_config (cfg -> plan)"
C = "(c) resolve_deployment alone"
D = "(d) plan.to_json()"
F = "(f) register_configs()"
E = "(e) miles-sglang plan --json, subprocess"
E_HYDRA = '  baseline: python -c "import hydra"'
E_BARE_APP = "  baseline: a bare Hydra app, one compose"
E_PASS = "  baseline: python -c pass"
E_SGLANG = "  baseline: import SGLang ServerArgs"

BARE_CONFIG = """\
# A trivial primary config: what a Hydra app composes without the sglang group.
seed: 1234
lr: 3.0e-4
model:
  path: /ckpt
  layers: 32
trainer:
  steps: 1000
  batch_size: 64
"""


def _time_interleaved(steps: dict[str, Callable[[], Any]], runs: int) -> dict[str, tuple[float, list[float]]]:
    """Per step: (first call, later calls) in seconds. The repetitions are interleaved round-robin, so that a
    load change on the machine hits every step alike and the ratios stay meaningful."""
    out: dict[str, tuple[float, list[float]]] = {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        fn()
        out[name] = (time.perf_counter() - t0, [])
    for _ in range(runs):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            out[name][1].append(time.perf_counter() - t0)
    return out


#: A whole Hydra app in a fresh process: the compose API on the trivial config, one override, the config printed.
#: Every Hydra app pays this (the interpreter, Hydra's imports, its plugin scan, one compose): the floor under
#: ``plan --json``, which is also one compose in a fresh process.
BARE_APP = """\
import sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose(config_name="bare", overrides=["trainer.steps=10"])
sys.stdout.write(OmegaConf.to_yaml(cfg))
"""


def _command(cmd: list[str], cwd: str) -> Callable[[], None]:
    # Bytecode is written, to a folder of the run's own (the checkout stays clean): an installed package has
    # its bytecode compiled, and a machine that sets PYTHONDONTWRITEBYTECODE would otherwise time the
    # compilation of every module of the package on each run (the warm-up run compiles them once).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPYCACHEPREFIX"] = str(Path(cwd, "pycache"))

    def once() -> None:
        subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    return once


def _miles_sglang_cmd() -> list[str]:
    script = Path(sys.executable).parent / "miles-sglang"
    if script.exists():
        return [str(script)]
    found = shutil.which("miles-sglang")
    return [found] if found else [sys.executable, "-m", "miles_sglang_plugin"]


def _sglang_baseline(cwd: str) -> dict[str, Callable[[], None]]:
    """``miles-sglang plan`` checks override keys against the installed SGLang's ServerArgs, which imports SGLang
    (and torch); this baseline times that import alone, where SGLang is installed."""
    from miles_sglang_plugin.rendering import sglang_server_args

    if importlib.util.find_spec("sglang") is None or not hasattr(sglang_server_args, "server_args_fields"):
        return {}
    code = "from miles_sglang_plugin.rendering.sglang_server_args import server_args_fields; server_args_fields()"
    return {E_SGLANG: _command([sys.executable, "-c", code], cwd)}


def run(runs: int, subprocess_runs: int) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.config.reading import spec_from_config, trainer_from_config
    from miles_sglang_plugin.config.store import register_configs
    from miles_sglang_plugin.planning.resolution import resolve_deployment

    with tempfile.TemporaryDirectory(prefix="bench_resolve_") as tmp:
        Path(tmp, "bare.yaml").write_text(BARE_CONFIG)

        def bare_compose() -> Any:
            GlobalHydra.instance().clear()
            try:
                with initialize_config_dir(config_dir=tmp, version_base=None):
                    return compose(config_name="bare", overrides=["trainer.steps=10"])
            finally:
                GlobalHydra.instance().clear()

        cfg = compose_config(OVERRIDES)
        spec, trainer = spec_from_config(cfg), trainer_from_config(cfg)
        plan = resolve_deployment(spec, trainer)
        got = {"total_gpus": plan.total_gpus, "models": len(plan.models), "engines": len(plan.engines)}
        assert got == EXPECTED, f"the benchmark deployment resolved to {got}, expected {EXPECTED}"
        json_bytes = len(plan.to_json().encode())

        rows = _time_interleaved(
            {
                A: bare_compose,
                B: lambda: resolve_config(compose_config(OVERRIDES)),
                B1: lambda: compose_config(OVERRIDES),
                B0: lambda: compose_config(SMALL_OVERRIDES),
                B2: lambda: resolve_config(cfg),
                C: lambda: resolve_deployment(spec, trainer),
                D: plan.to_json,
                F: register_configs,
            },
            runs,
        )
        if subprocess_runs > 0:
            rows.update(
                _time_interleaved(
                    {
                        E: _command([*_miles_sglang_cmd(), "plan", "--json", *OVERRIDES], tmp),
                        E_HYDRA: _command([sys.executable, "-c", "import hydra"], tmp),
                        E_BARE_APP: _command([sys.executable, "-c", BARE_APP, tmp], tmp),
                        E_PASS: _command([sys.executable, "-c", "pass"], tmp),
                        **_sglang_baseline(tmp),
                    },
                    subprocess_runs,
                )
            )

    import hydra
    import omegaconf

    stats = {
        name: {
            "first_s": first,
            "median_s": statistics.median(samples),
            "min_s": min(samples),
            "runs": len(samples),
        }
        for name, (first, samples) in rows.items()
    }
    a, b = stats[A]["median_s"], stats[B]["median_s"]
    result: dict[str, Any] = {
        "python": sys.version.split()[0],
        "hydra_core": hydra.__version__,
        "omegaconf": omegaconf.__version__,
        "deployment": {**got, "plan_json_bytes": json_bytes},
        "timings": stats,
        "ratio_b_over_a": b / a,
        "ratio_b_over_a_min": stats[B]["min_s"] / stats[A]["min_s"],
    }
    if subprocess_runs > 0:
        result["ratio_cli_over_import_hydra"] = stats[E]["median_s"] / stats[E_HYDRA]["median_s"]
        result["ratio_cli_over_import_hydra_min"] = stats[E]["min_s"] / stats[E_HYDRA]["min_s"]
        result["ratio_bare_app_over_import_hydra"] = (
            stats[E_BARE_APP]["median_s"] / stats[E_HYDRA]["median_s"]
        )
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f}"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    d = result["deployment"]
    table = Table(
        title=f"miles_sglang_plugin timings (ms) — {d['total_gpus']} GPUs, {d['models']} models, "
        f"{d['engines']} engines; plan JSON {d['plan_json_bytes']:,} bytes",
        caption=f"Python {result['python']}, hydra-core {result['hydra_core']}, omegaconf {result['omegaconf']}",
    )
    table.add_column("step", no_wrap=True)
    for col in ("median", "min", "first call", "runs"):
        table.add_column(col, justify="right")
    for name, s in result["timings"].items():
        table.add_row(name, _ms(s["median_s"]), _ms(s["min_s"]), _ms(s["first_s"]), str(s["runs"]))
    console = Console(highlight=False, width=max(Console().width, 100))
    console.print(table)
    console.print(
        f"(b)/(a): {result['ratio_b_over_a']:.1f}x (medians), {result['ratio_b_over_a_min']:.1f}x (minimums)"
    )
    if "ratio_cli_over_import_hydra" in result:
        console.print(
            f'(e) miles-sglang plan --json / python -c "import hydra": {result["ratio_cli_over_import_hydra"]:.1f}x '
            f"(medians), {result['ratio_cli_over_import_hydra_min']:.1f}x (minimums); a bare Hydra app, one "
            f"compose: {result['ratio_bare_app_over_import_hydra']:.1f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=50, help="timed in-process repetitions per step (default 50)"
    )
    parser.add_argument(
        "--subprocess-runs", type=int, default=5, help="timed repetitions per subprocess command (0: skip)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one repetition of every step (CI: proves the benchmark still runs; the numbers mean nothing)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.subprocess_runs = 1, 1
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    result = run(args.runs, args.subprocess_runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
