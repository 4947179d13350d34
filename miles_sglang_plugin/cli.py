"""``miles-sglang``: look at, convert and launch SGLang deployments described with the ``sglang`` group.

miles-sglang plan [--json] [HYDRA OVERRIDES...]
miles-sglang sweep-report SWEEP_DIR [--no-plot]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.miles import commands as miles_commands

EXIT_USER_ERROR = 2


def _out_console() -> Console:
    # Not a terminal (a pipe, a file, a test): wide enough that engine ids are never cut.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.planning.views import print_plan
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
    from miles_sglang_plugin.rendering.views import print_commands

    known = known_server_arg_fields()
    prepared = prepare_from_config(compose_config(args.overrides))
    plan = prepared.plan
    if args.json:
        data = prepared.to_dict()
        data["server_args_checked_against"] = known.source
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return 0
    console = _out_console()
    print_plan(plan, console)
    if args.commands:
        print_commands(prepared.launch, console)
    console.print(f"override keys checked against {known.source}")
    for note in prepared.launch.notes:
        console.print(f"note: {note}")
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    """Serve a deployment without training (the seeds' standalone launcher) until Ctrl-C or SIGTERM."""
    import time
    from pathlib import Path

    from miles_sglang_plugin.app.hydra_edge import launch_from_config

    cfg = compose_config(args.overrides)
    console = _err_console()
    with launch_from_config(cfg, log_dir=Path(args.log_dir) if args.log_dir else None) as deployment:
        registry = deployment.registry
        for name in registry.names():
            sys.stdout.write(f"{name} {registry[name].base_url}\n")
        sys.stdout.write(f"export {' '.join(f'{k}={v!r}' for k, v in registry.to_env().items())}\n")
        sys.stdout.flush()
        console.print(
            f"serving; logs in {deployment.log_dir}; Ctrl-C stops every engine and router", markup=False
        )
        while not deployment.exited():
            time.sleep(1.0)
        console.print("[bold red]error:[/] " + escape("; ".join(deployment.exit_report())))
        return 1


def _cmd_sweep_report(args: argparse.Namespace) -> int:
    """Rebuild the sweep report (table and plot) from a sweep directory's jobs."""
    from pathlib import Path

    from miles_sglang_plugin.sweeps.report import SweepReportError, build_report

    try:
        build_report(Path(args.sweep_dir), console=_out_console(), plot=not args.no_plot)
    except SweepReportError as exc:
        _err_console().print(f"[bold red]error:[/] {escape(str(exc))}")
        return EXIT_USER_ERROR
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-sglang",
        description="Describe, check and launch the SGLang engines and routers of an RL trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser(
        "plan",
        help="resolve a deployment and print it (GPUs per node, engines, offload, update_weights)",
        description="Resolve the deployment composed from the `sglang` group and Hydra overrides, e.g. "
        "`miles-sglang plan sglang=pd_actor_ref sglang.actor.decode.num_gpus=12 hf_checkpoint=/ckpt`.",
    )
    p_plan.add_argument("--json", action="store_true", help="print the plan as JSON (fields: see README)")
    p_plan.add_argument(
        "--commands", action="store_true", help="also print each engine's command line and GPU pinning"
    )
    p_plan.add_argument("overrides", nargs="*", help="Hydra overrides")
    p_plan.set_defaults(func=_cmd_plan)
    p_launch = sub.add_parser(
        "launch",
        help="start the deployment's engines and routers and serve until Ctrl-C",
        description="Start every engine and one router per model, print the router URLs, serve until Ctrl-C or "
        "SIGTERM, then stop everything. On a machine without GPUs add sglang_deploy=simulated (stand-in engines).",
    )
    p_launch.add_argument("--log-dir", help="engine and router logs (default: ./sglang_logs/<time>)")
    p_launch.add_argument("overrides", nargs="*", help="Hydra overrides")
    p_launch.set_defaults(func=_cmd_launch)
    p_report = sub.add_parser(
        "sweep-report",
        help="rebuild a sweep's report (Markdown and CSV table, PNG plot) from its directory",
        description="Collect every job of a Hydra multirun's sweep directory (its overrides, plan.json, "
        "metrics.json, job_status.json) into sweep_report.md, sweep_report.csv and sweep_report.png there.",
    )
    p_report.add_argument(
        "sweep_dir", help="the sweep directory (hydra.sweep.dir, e.g. multirun/<date>/<time>)"
    )
    p_report.add_argument("--no-plot", action="store_true", help="write the table only")
    p_report.set_defaults(func=_cmd_sweep_report)
    miles_commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CompositionError, DeploymentConfigError) as exc:
        _err_console().print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        return EXIT_USER_ERROR
    except LaunchError as exc:
        _err_console().print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        return 1
    except KeyboardInterrupt:
        _err_console().print("interrupted: every engine and router was stopped")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
