"""Human-readable view of the launch specs: each engine process's command line and each router."""

from __future__ import annotations

from rich.console import Console

from miles_sglang_plugin.rendering.launch_specs import LaunchSpecs


def print_commands(launch: LaunchSpecs, console: Console | None = None) -> None:
    """Each engine process's command line (secrets masked) and GPU pinning; each router's URL."""
    console = console or Console()
    for e in launch.engines:
        console.print(f"[bold]{e.name}[/] node {e.node} CUDA_VISIBLE_DEVICES={e.env['CUDA_VISIBLE_DEVICES']}")
        console.print(f"  {e.display_command()}", markup=False, soft_wrap=True)
    for r in launch.routers:
        mode = "pd" if r.spec.pd_disaggregation else "regular"
        console.print(
            f"[bold]router {r.model}[/] {r.spec.url} ({mode}, policy {r.spec.settings.policy}, "
            f"{len(r.workers)} workers)"
        )
