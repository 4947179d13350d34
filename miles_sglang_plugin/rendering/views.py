"""Human-readable view of the launch specs: each engine process's command line and each router. A command line
runs as printed when pasted into bash (:func:`~miles_sglang_plugin.printable.shell_join`); names and addresses
show control characters escaped."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from miles_sglang_plugin.printable import escape_controls, shell_quote
from miles_sglang_plugin.rendering.launch_specs import LaunchSpecs


def _shown(text: str) -> str:
    """``text`` as rich markup's plain text, control characters escaped."""
    return escape(escape_controls(text))


def print_commands(launch: LaunchSpecs, console: Console | None = None) -> None:
    """Each engine process's command line (secrets masked), the node it runs on and its GPU pinning; each
    router's URL. Addresses written ``<node N address>`` are each node's, filled in at launch."""
    console = console or Console()
    for process in launch.engines:
        rank = f", node rank {process.node_rank} of {process.nnodes}" if process.nnodes > 1 else ""
        console.print(
            f"[bold]{_shown(process.name)}[/] on node {process.node} ({_shown(process.host)}{rank}) "
            f"CUDA_VISIBLE_DEVICES={_shown(shell_quote(process.env['CUDA_VISIBLE_DEVICES']))}"
        )
        console.print(f"  {process.display_command()}", markup=False, soft_wrap=True)
    for router in launch.routers:
        mode = "pd" if router.spec.pd_disaggregation else "regular"
        console.print(
            f"[bold]router {_shown(router.model)}[/] {_shown(router.spec.url)} ({mode}, "
            f"policy {_shown(str(router.spec.settings.policy))}, {len(router.workers)} workers)"
        )
    if any(process.host.startswith("<") for process in launch.engines):
        console.print(
            "addresses in <...> are decided at launch: each node's own address (from the cluster), the "
            "routers on the driver's node; ports are per node"
        )
