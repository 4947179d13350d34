"""An app's ``--help`` lists the ``sglang`` group where the app placed it.

Hydra's help lists every config group of the search path by its own name (``sglang: actor_ref, ..., pd``), as
if the group were at the root. An app that places it elsewhere (``- /sglang@engines: pd`` inside its rollout
node) is overridden as ``sglang@actor_rollout_ref.rollout.engines=pd``; ``sglang=pd`` would add a second
deployment at the root. So the help names the group at each package Hydra's record of the app's choices
(``hydra.runtime.choices``) holds it, and the helper groups at theirs, under a model of the group
(``sglang_model@actor_rollout_ref.rollout.engines.<model>: base``): what the user types.

Hydra has no hook for the listing; :func:`install_help_placement` wraps ``Hydra.format_config_groups`` (the
one function that writes it, for ``--help`` only) once, from the plugin's search-path module. Where the app
does not use the group, or Hydra's record is not there (``--hydra-help``), the listing is Hydra's own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

#: The group whose placement the help shows.
GROUP = "sglang"
#: Helper groups -> where they go under a placement of the group (``{package}``: the group's package).
HELPER_PLACES = {
    "sglang_model": "{package}.<model>",
    "sglang_group": "{package}.<model>.extra_groups.<name>",
}


def group_packages(choices: Mapping[str, Any]) -> list[str]:
    """The packages the app placed the group at, from Hydra's choices (``sglang`` at the root: ``sglang``;
    ``sglang@actor_rollout_ref.rollout.engines``: that package), in the order Hydra recorded them."""
    packages = []
    for key in choices:
        name, _, package = str(key).partition("@")
        if name == GROUP:
            packages.append(package or GROUP)
    return packages


def _blocks(listing: str) -> list[list[str]]:
    """Hydra's listing as blocks of lines: a group's line (``name: options``, or ``name:`` with its options
    indented under it in the long form), then those option lines."""
    blocks: list[list[str]] = []
    for line in listing.splitlines():
        if line.startswith(" ") and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return blocks


def _shown_at(group: str, packages: list[str]) -> list[str]:
    """The names a group is listed under: ``group@package`` for each placement, or its own name."""
    if group == GROUP:
        return [GROUP if package == GROUP else f"{GROUP}@{package}" for package in packages]
    if group in HELPER_PLACES:
        return [f"{group}@{HELPER_PLACES[group].format(package=package)}" for package in packages]
    return [group]


def with_group_packages(listing: str, choices: Mapping[str, Any]) -> str:
    """Hydra's config-group listing with the group, and its helper groups, named at the app's packages."""
    packages = group_packages(choices)
    if not packages:
        return listing
    lines: list[str] = []
    for block in _blocks(listing):
        group, colon, rest = block[0].partition(":")
        if not colon:
            lines.extend(block)
            continue
        for name in _shown_at(group, packages):
            lines.extend([f"{name}:{rest}", *block[1:]])
    return "".join(f"{line}\n" for line in lines)


def _app_choices() -> Mapping[str, Any]:
    """Hydra's record of the app's choices, while its help is written (empty where there is none)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return choices if choices is not None else {}


def install_help_placement() -> None:
    """Make Hydra's ``--help`` name the group at the app's packages (idempotent)."""
    from hydra._internal.hydra import Hydra

    original = Hydra.format_config_groups
    if getattr(original, "_msp_group_packages", False):
        return

    @functools.wraps(original)
    def format_config_groups(self: Any, predicate: Any, compact: bool = True) -> str:
        return with_group_packages(original(self, predicate, compact), _app_choices())

    format_config_groups._msp_group_packages = True  # type: ignore[attr-defined]
    Hydra.format_config_groups = format_config_groups  # type: ignore[method-assign]
