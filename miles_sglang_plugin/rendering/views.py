"""Human-readable view of the launch specs: each engine process's command line and each router."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from miles_sglang_plugin.rendering.launch_specs import LaunchSpecs


def print_commands(launch: LaunchSpecs, console: Console | None = None) -> None:
    """Each engine process's command line (secrets masked), the node it runs on and its GPU pinning; each
    router's URL. Addresses written ``<node N address>`` are each node's, filled in at launch."""
    console = console or Console()
    for e in launch.engines:
        rank = f", node rank {e.node_rank} of {e.nnodes}" if e.nnodes > 1 else ""
        console.print(
            f"[bold]{escape(e.name)}[/] on node {e.node} ({escape(e.host)}{rank}) "
            f"CUDA_VISIBLE_DEVICES={e.env['CUDA_VISIBLE_DEVICES']}"
        )
        console.print(f"  {e.display_command()}", markup=False, soft_wrap=True)
    for r in launch.routers:
        mode = "pd" if r.spec.pd_disaggregation else "regular"
        console.print(
            f"[bold]router {escape(r.model)}[/] {escape(r.spec.url)} ({mode}, policy {r.spec.settings.policy}, "
            f"{len(r.workers)} workers)"
        )
    if any(e.host.startswith("<") for e in launch.engines):
        console.print(
            "addresses in <...> are decided at launch: each node's own address (from the cluster), the "
            "routers on the driver's node; ports are per node"
        )
