"""``miles-sglang``: look at, convert and launch SGLang deployments described with the ``sglang`` group.

miles-sglang plan [--json] [HYDRA OVERRIDES...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from miles_sglang_plugin.compose import CompositionError, compose_config
from miles_sglang_plugin.errors import DeploymentConfigError

EXIT_USER_ERROR = 2


def _out_console() -> Console:
    # Not a terminal (a pipe, a file, a test): wide enough that engine ids are never cut.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    from miles_sglang_plugin.hydra_config import resolve_config
    from miles_sglang_plugin.plan_view import print_plan

    cfg = compose_config(args.overrides)
    plan = resolve_config(cfg)
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
    else:
        print_plan(plan, _out_console())
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
    p_plan.add_argument("overrides", nargs="*", help="Hydra overrides")
    p_plan.set_defaults(func=_cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CompositionError, DeploymentConfigError) as exc:
        _err_console().print(f"[bold red]error:[/] {exc}", markup=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
