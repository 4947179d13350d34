"""``miles-sglang``: look at, convert and launch SGLang deployments described with the ``sglang`` group.

miles-sglang plan [--json] [--commands] [--picture FILE.svg] [-cp DIR -cn NAME] [-cd DIR] [--sglang-key KEY]
                  [HYDRA OVERRIDES...]
miles-sglang plan --diff OLD NEW [HYDRA OVERRIDES...]   (OLD, NEW: a preset name or quoted overrides)
miles-sglang fields [PATH]
miles-sglang fields --overrides [TEXT]
miles-sglang launch [--log-dir DIR] [HYDRA OVERRIDES...]
miles-sglang sweep-report SWEEP_DIR [--no-plot]
miles-sglang import / export (see miles_sglang_plugin.miles.commands)

Only the standard library is imported at module level: everything else loads inside :func:`main`, so that a
Ctrl-C while the command starts up ends it with one line and status 130, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
#: 128 + SIGPIPE, as a shell reports a command whose reader went away (``plan --json | head``).
EXIT_BROKEN_PIPE = 141


def _out_console() -> Any:
    from rich.console import Console

    # Not a terminal (a pipe, a file, a test): wide enough that engine ids are never cut.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _err_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _print_error(message: str) -> None:
    from rich.markup import escape

    from miles_sglang_plugin.printable import escape_controls

    _err_console().print(
        f"[bold red]error:[/] {escape(escape_controls(message, keep_newlines=True))}", markup=True
    )


class _LogLineFormatter(logging.Formatter):
    """One line per record: a supervision event's kind (``engine_lost: ...``), else the level, then the text
    (control characters escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        from miles_sglang_plugin.printable import escape_controls

        text = escape_controls(super().format(record), keep_newlines=True)
        return f"{getattr(record, 'msp_event', None) or record.levelname.lower()}: {text}"


@contextlib.contextmanager
def log_to_stderr(level: int = logging.INFO) -> Iterator[logging.Handler]:
    """For the block, show the plugin's log (logger ``miles_sglang_plugin``: the supervisor's engine and router
    losses, restarts and recoveries, and every other warning) on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogLineFormatter("%(message)s"))
    package_logger = logging.getLogger("miles_sglang_plugin")
    before = (package_logger.level, package_logger.propagate)
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    package_logger.propagate = False  # once, here, not again through a root handler
    try:
        yield handler
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(before[0])
        package_logger.propagate = before[1]


def _composed(args: argparse.Namespace, extra: Sequence[str] = ()) -> Any:
    """The config ``plan`` shows: the command's own primary config, or the app's (``-cp`` / ``-cn``)."""
    from miles_sglang_plugin.config.compose import PRIMARY_CONFIG, compose_config

    return compose_config(
        [*args.overrides, *extra],
        args.config_name or PRIMARY_CONFIG,
        config_dir=args.config_path,
        search_dirs=[args.config_dir] if args.config_dir else [],
        return_hydra_config=True,  # Hydra's record of where the group was placed
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    with _rare_collections():
        return _plan(args)


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """The cyclic collector's passes made rarer (as mypy's command line sets them), Python's own thresholds
    back afterwards (``main`` may run inside a longer process): a plan is many small objects without cycles,
    made once, and at the GPU cap the passes over them took a quarter of the time and freed nothing."""
    before = gc.get_threshold()
    gc.set_threshold(200_000, 30, 30)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _plan(args: argparse.Namespace) -> int:
    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields

    known = known_server_arg_fields()
    if args.diff is not None:
        return _plan_diff(args)
    if args.picture is not None and not args.picture.lower().endswith(".svg"):
        _print_error(f"--picture {args.picture}: the picture is SVG; give a file name ending in .svg")
        return EXIT_USER_ERROR
    prepared = prepare_from_config(_composed(args), sglang_key=args.sglang_key)
    if args.picture is not None and not _write_picture(prepared.plan, args.picture):
        return EXIT_USER_ERROR
    if args.json:
        prepared.write_json(sys.stdout, server_args_checked_against=known.source)
        return 0
    from miles_sglang_plugin.planning.views import print_plan  # the tables (rich) only for the text form
    from miles_sglang_plugin.printable import escape_controls
    from miles_sglang_plugin.rendering.views import print_commands

    console = _out_console()
    print_plan(prepared.plan, console)
    if args.commands:
        print_commands(prepared.launch, console)
    console.print(f"override keys checked against {known.source}", markup=False)
    for note in prepared.launch.notes:
        console.print(f"note: {escape_controls(note, keep_newlines=True)}", markup=False)
    return 0


def _write_picture(plan: Any, path: str) -> bool:
    """``plan``'s GPU placement as SVG at ``path`` (False, with the reason on stderr, where it cannot be
    written)."""
    from pathlib import Path

    from miles_sglang_plugin.planning.picture import placement_svg

    try:
        Path(path).write_text(placement_svg(plan), encoding="utf-8")
    except OSError as exc:
        _print_error(f"--picture {path}: cannot write it: {exc.strerror or exc}")
        return False
    _err_console().print(f"wrote the GPU placement picture to {path}", markup=False)
    return True


def _diff_side(side: str) -> list[str]:
    """One side of ``--diff``: a preset name of the group (``pd``) or overrides (``"a=1 b=2"``)."""
    import shlex

    words = shlex.split(side)
    return words if any("=" in word for word in words) else [f"sglang={side}"]


def _plan_diff(args: argparse.Namespace) -> int:
    """What ``Deployment.apply`` would do to a deployment of OLD given NEW: kept, started, stopped, replaced,
    with GPUs and nodes, before anything runs."""
    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.rendering.prepared import prepare_deployment
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
    from miles_sglang_plugin.serving.elastic import plan_change, result_of

    fields = known_server_arg_fields().fields
    old_side, new_side = args.diff
    old = prepare_from_config(_composed(args, _diff_side(old_side)), sglang_key=args.sglang_key)
    new = prepare_from_config(_composed(args, _diff_side(new_side)), sglang_key=args.sglang_key)

    def render(plan: Any, ports: Any) -> Any:
        return prepare_deployment(plan, new.settings, server_arg_fields=fields, fixed_ports=ports)

    change = plan_change(old, new.plan, render, settings=new.settings)
    console = _out_console()
    for line in result_of(change, {}, 0.0, dry_run=True).lines():
        console.print(line, markup=False)
    return 0


def _cmd_fields(args: argparse.Namespace) -> int:
    import shutil

    from miles_sglang_plugin.config.field_docs import (
        TEXT_WIDTH,
        close_keys,
        schema_fields,
        select_fields,
        text_lines,
    )
    from miles_sglang_plugin.config.schema import MilesTrainerArgs

    if args.override_keys:
        return _override_keys(args.path)
    rows = schema_fields(MilesTrainerArgs)
    selected = select_fields(rows, args.path) if args.path else rows
    if not selected:
        close = close_keys(rows, args.path)
        hint = f"; did you mean {', '.join(close)}?" if close else "; miles-sglang fields lists every key"
        _print_error(f"no config key {args.path!r}{hint}")
        return EXIT_USER_ERROR
    # A terminal's width (COLUMNS counts), else 100 columns; keys are never cut, whatever the width.
    width = shutil.get_terminal_size((TEXT_WIDTH, 24)).columns if sys.stdout.isatty() else TEXT_WIDTH
    sys.stdout.write("\n".join(text_lines(selected, max(width, 40))) + "\n")
    return 0


def _override_keys(contains: str | None) -> int:
    """``fields --overrides [TEXT]``: the keys a group's ``overrides`` accept, with SGLang's help text."""
    import shutil

    from miles_sglang_plugin.config.field_docs import TEXT_WIDTH, text_lines
    from miles_sglang_plugin.rendering.override_keys import SGLANG_SERVER_ARGS_DOCS, override_keys
    from miles_sglang_plugin.rendering.sglang_server_args import suggest_field_names

    keys = override_keys(contains)
    if not keys.rows:
        close = suggest_field_names(contains or "", [r.key for r in override_keys().rows])
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else "; miles-sglang fields --overrides lists them all"
        )
        _print_error(f"no override key holds {contains!r}{hint}")
        return EXIT_USER_ERROR
    width = shutil.get_terminal_size((TEXT_WIDTH, 24)).columns if sys.stdout.isatty() else TEXT_WIDTH
    head = [
        f"Keys of a group's overrides (sglang.<model>.<group>.overrides.<key>) and of "
        f"sglang_deploy.server_defaults.<key>: the ServerArgs fields of {keys.source}"
        + (f", those holding {contains!r}" if contains else "")
        + f": {len(keys.rows)}. SGLang's docs: {SGLANG_SERVER_ARGS_DOCS}",
        "Set by the plan, refused in both: " + ", ".join(sorted(keys.plan_owned)),
        "Refused in server_defaults only (each group's own): " + ", ".join(sorted(keys.group_owned)),
        "",
    ]
    sys.stdout.write("\n".join([*head, *text_lines(keys.rows, max(width, 40))]) + "\n")
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    """Serve a deployment without training (the seeds' standalone launcher) until Ctrl-C or SIGTERM.

    With supervision on (the default), a lost engine or router is reported and healed while the others serve;
    the command ends (status 1) only when the deployment fails whole. With it off, the first process that
    exits stops everything."""
    import time
    from pathlib import Path

    from rich.markup import escape

    from miles_sglang_plugin.app.hydra_edge import launch_from_config
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.printable import escape_controls, shell_quote

    cfg = compose_config(args.overrides)
    console = _err_console()
    with (
        log_to_stderr(),  # engine losses, restarts, recoveries (supervision events) and any other warning
        launch_from_config(cfg, log_dir=Path(args.log_dir) if args.log_dir else None) as deployment,
    ):
        registry = deployment.registry
        for name in registry.names():
            sys.stdout.write(f"{name} {registry[name].base_url}\n")
        sys.stdout.write(
            f"export {' '.join(f'{k}={shell_quote(v)}' for k, v in registry.to_env().items())}\n"
        )
        sys.stdout.flush()
        console.print(
            f"serving; logs in {deployment.log_dir}; Ctrl-C stops every engine and router", markup=False
        )
        supervised = deployment.settings.supervision.enabled
        while (
            deployment.failure is None
            and deployment.stop_signal is None
            and (supervised or not deployment.exited())
        ):
            time.sleep(0.5)
        if deployment.stop_signal is not None:  # stopped by Ctrl-C/SIGTERM, which reaches this process next
            return 128 + deployment.stop_signal
        if deployment.failure is None:
            report = "; ".join(deployment.exit_report())
            console.print("[bold red]error:[/] " + escape(escape_controls(report, keep_newlines=True)))
        return 1  # a failure raises DeploymentFailedError when the block ends


def _cmd_sweep_report(args: argparse.Namespace) -> int:
    """Rebuild the sweep report (table and plot) from a sweep directory's jobs."""
    from pathlib import Path

    from miles_sglang_plugin.sweeps.report import SweepReportError, build_report

    try:
        build_report(Path(args.sweep_dir), console=_out_console(), plot=not args.no_plot)
    except SweepReportError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    return 0


def _add_sweep_report(sub: Any) -> None:
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


def _add_plan(sub: Any) -> None:
    p_plan = sub.add_parser(
        "plan",
        help="resolve a deployment and print it (GPUs per node, engines, offload, update_weights)",
        description="Resolve the deployment composed from the `sglang` group and Hydra overrides, e.g. "
        "`miles-sglang plan sglang=pd_actor_ref sglang.actor.decode.num_gpus=12 hf_checkpoint=/ckpt`; with "
        "-cp/-cn, an app's own primary config (YAML; configs an app stores from its own code are not "
        "there: use the app's dry run, hydra/callbacks=sglang_plan).",
    )
    p_plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON (fields: the docs' miles-sglang page)"
    )
    p_plan.add_argument(
        "--picture",
        metavar="FILE.svg",
        help="also draw the GPU placement as SVG: one row per node, one cell per GPU, labelled with its engine",
    )
    p_plan.add_argument(
        "--commands", action="store_true", help="also print each engine's command line and GPU pinning"
    )
    p_plan.add_argument(
        "--diff",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="what a running deployment of OLD does given NEW (Deployment.apply): engines kept, started, "
        "stopped, replaced, their GPUs and nodes; each a preset name of the group or quoted overrides "
        "(the other overrides apply to both)",
    )
    p_plan.add_argument(
        "-cp", "--config-path", metavar="DIR", help="the app's primary config directory (relative to here)"
    )
    p_plan.add_argument("-cn", "--config-name", metavar="NAME", help="the app's primary config name")
    p_plan.add_argument("-cd", "--config-dir", metavar="DIR", help="a further config directory to search")
    p_plan.add_argument(
        "--sglang-key", metavar="KEY", help="where the group is (default: where Hydra placed it, else sglang)"
    )
    p_plan.add_argument("overrides", nargs="*", help="Hydra overrides")
    p_plan.set_defaults(func=_cmd_plan)


def _add_fields(sub: Any) -> None:
    p_fields = sub.add_parser(
        "fields",
        help="document the config keys: type, default, what and unit",
        description="Print every config key of the group (or those at and under PATH, e.g. sglang.actor.decode "
        "or sglang_deploy.launch) with its type, default and docstring, read from the schema itself.",
    )
    p_fields.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="a dotted key (model and group names as used); with --overrides, text the keys must hold",
    )
    p_fields.add_argument(
        "--overrides",
        dest="override_keys",
        action="store_true",
        help="list the keys a group's overrides (and sglang_deploy.server_defaults) accept: SGLang's ServerArgs "
        "fields, with SGLang's help text where SGLang is installed, and a link to SGLang's docs",
    )
    p_fields.set_defaults(func=_cmd_fields)


def _add_launch(sub: Any) -> None:
    p_launch = sub.add_parser(
        "launch",
        help="start the deployment's engines and routers and serve until Ctrl-C",
        description="Start every engine and one router per model, print the router URLs, serve until Ctrl-C or "
        "SIGTERM, then stop everything. On a machine without GPUs add sglang_deploy=simulated (stand-in engines).",
    )
    p_launch.add_argument("--log-dir", help="engine and router logs (default: ./sglang_logs/<time>)")
    p_launch.add_argument("overrides", nargs="*", help="Hydra overrides")
    p_launch.set_defaults(func=_cmd_launch)


def build_parser() -> argparse.ArgumentParser:
    from miles_sglang_plugin.miles import commands as miles_commands

    parser = argparse.ArgumentParser(
        prog="miles-sglang",
        description="Describe, check and launch the SGLang engines and routers of an RL trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_fields(sub)
    _add_launch(sub)
    _add_sweep_report(sub)
    miles_commands.register(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, options and overrides in any order (``plan a=1 --json b=2``: argparse alone takes the
    overrides only up to the first option); an unknown option is argparse's usual error."""
    args, rest = parser.parse_known_args(argv)
    if not rest:
        return args
    if any(token.startswith("-") for token in rest) or not hasattr(args, "overrides"):
        parser.parse_args(argv)  # argparse's own message and exit status 2
    args.overrides = [*args.overrides, *rest]
    return args


#: The commands whose work is what they print: a reader of their output that goes away ends them (a launch's
#: broken pipe is a socket's or a child's, and fails it as any other error does).
_PRINTING_COMMANDS = frozenset({"plan", "fields", "sweep-report", "import", "export"})


def _run(argv: Sequence[str] | None) -> int:
    from miles_sglang_plugin.backends.base import LaunchError
    from miles_sglang_plugin.config.compose import CompositionError
    from miles_sglang_plugin.errors import DeploymentConfigError

    args = _parse(build_parser(), argv)
    if args.command == "plan" and args.config_path and not args.config_name:
        _print_error("-cp/--config-path needs -cn/--config-name (the primary config in that directory)")
        return EXIT_USER_ERROR
    try:
        return int(args.func(args))
    except (CompositionError, DeploymentConfigError) as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    except LaunchError as exc:
        _print_error(str(exc))
        return 1
    except BrokenPipeError:
        if args.command not in _PRINTING_COMMANDS:
            raise
        # The reader of stdout went away (``| head``): stop quietly, as a shell tool does. What is still buffered
        # goes to /dev/null, so that the interpreter's last flush does not report the same broken pipe.
        import os

        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        started = args.command == "launch"  # only a launch has anything to stop
        sys.stderr.write("interrupted: every engine and router was stopped\n" if started else "interrupted\n")
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # while the command's modules load, before anything started
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
