"""Human-readable view of the launch specs: each engine process's command line and each router."""

from __future__ import annotations

from rich.console import Console

from miles_sglang_plugin.rendering.launch_specs import LaunchSpecs


def print_commands(launch: LaunchSpecs, console: Console | None = None) -> None:
    """Each engine process's command line (secrets masked) and GPU pinning; each router's URL."""
    console = console or Console()
    for process in launch.engines:
        pinning = process.env["CUDA_VISIBLE_DEVICES"]
        console.print(f"[bold]{process.name}[/] node {process.node} CUDA_VISIBLE_DEVICES={pinning}")
        console.print(f"  {process.display_command()}", markup=False, soft_wrap=True)
    for router in launch.routers:
        mode = "pd" if router.spec.pd_disaggregation else "regular"
        console.print(
            f"[bold]router {router.model}[/] {router.spec.url} ({mode}, "
            f"policy {router.spec.settings.policy}, {len(router.workers)} workers)"
        )
