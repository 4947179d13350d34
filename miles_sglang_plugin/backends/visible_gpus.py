"""The GPUs a scheduler gave the launcher: an inherited ``CUDA_VISIBLE_DEVICES`` (Slurm, submitit, a Ray actor,
a sweep job's slice) is the machine's GPUs as far as the deployment goes.

The plan numbers each node's GPUs 0, 1, ... (``local_gpu_ids``); with an inherited list those are positions in
it: ``CUDA_VISIBLE_DEVICES=4,5,6,7`` and engines on local GPUs ``0,1`` and ``2,3`` see ``4,5`` and ``6,7``. A plan
that needs more GPUs than the list holds is refused before anything starts. Without the variable the local
ids are the machine's own.

A list that cannot be a set of distinct GPUs is refused before anything starts (:func:`gpu_list_problems`): a
GPU named twice (``0,0``; ``GPU-ab,GPU-abcd``, as CUDA takes a UUID's first characters), an empty entry, an
entry that is neither an index nor a UUID (``-1``: CUDA hides that entry and every GPU after it), and a list
that mixes indices and UUIDs (one GPU could be in it twice under two names). The packed launcher checks its
GPUs with the same rules.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from collections.abc import Mapping, Sequence

from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.rendering.prepared import PreparedDeployment

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


#: The most GPUs a list may name (far above any machine's; reading is bounded).
MAX_VISIBLE_GPUS = 4096
#: The most problems of one list reported (the rest counted).
MAX_PROBLEMS = 8
_INDEX = re.compile(r"[0-9]+")
#: A GPU or MIG UUID as nvidia-smi shows it (``GPU-1a2b…``, ``MIG-…``, ``MIG-GPU-…/1/0``), or its first characters.
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*")
#: Where an entry is invalid: what CUDA does with it (it enumerates the GPUs before it, none after).
_HIDES = "CUDA hides it and every GPU after it"


def _shown(entry: str) -> str:
    return repr(entry if len(entry) <= 40 else entry[:40] + "…")


def _entry_problems(entries: Sequence[str]) -> list[str]:
    problems = []
    for position, entry in enumerate(entries, 1):
        if not entry:
            problems.append(
                f"has an empty entry (entry {position}, a stray comma?): every entry must name a GPU"
            )
        elif entry.startswith("-") and _INDEX.fullmatch(entry[1:]):
            problems.append(
                f"has entry {position} ({entry}), which is not a GPU: {_HIDES} (an empty "
                f"{VISIBLE_DEVICES_ENV} means no GPU)"
            )
        elif not (_INDEX.fullmatch(entry) or _UUID.fullmatch(entry)):
            problems.append(
                f"has entry {position} ({_shown(entry)}), which is neither a GPU index (0, 1, ...) nor a GPU UUID "
                f"(GPU-..., MIG-...): {_HIDES}"
            )
    return problems


def _twice(entries: Sequence[str]) -> list[str]:
    """GPUs the list names twice: equal indices (``0``, ``00``) or UUIDs; and UUIDs that may name one GPU (equal
    but for case, or one the start of another). Entries that name no GPU are left to :func:`_entry_problems`."""
    first: dict[str, int] = {}
    problems = []
    for position, entry in enumerate(entries, 1):
        if not (_INDEX.fullmatch(entry) or _UUID.fullmatch(entry)):
            continue  # reported as not a GPU
        name = str(int(entry)) if _INDEX.fullmatch(entry) else entry
        if name in first:
            written = (
                ""
                if name == entry == entries[first[name] - 1]
                else f": {entries[first[name] - 1]} and {entry}"
            )
            problems.append(
                f"names GPU {_shown(name) if len(name) > 40 else name} twice (entries {first[name]} and "
                f"{position}{written}): engines would share it; list each GPU once"
            )
        else:
            first[name] = position
    uuids = sorted((name.lower(), name, position) for name, position in first.items() if not name.isdigit())
    for i, (lower, name, position) in enumerate(uuids):
        for other_lower, other, other_position in uuids[i + 1 :]:
            if not other_lower.startswith(lower):
                break  # sorted: the names starting with this one come right after it
            a, b = sorted([(position, name), (other_position, other)])
            problems.append(
                f"may name one GPU twice (entries {a[0]} and {b[0]}: {_shown(a[1])} and {_shown(b[1])}; CUDA takes "
                "a UUID's first characters): give each GPU's whole UUID once"
            )
    return problems


def gpu_list_problems(entries: Sequence[str]) -> list[str]:
    """What keeps ``entries`` (already split at commas, blanks stripped) from naming distinct GPUs, in the words
    of one problem each (no key): see the module's docstring."""
    if len(entries) > MAX_VISIBLE_GPUS:
        return [f"lists {len(entries)} GPUs, more than {MAX_VISIBLE_GPUS}"]
    problems = _entry_problems(entries)
    valid = [e for e in entries if _INDEX.fullmatch(e) or _UUID.fullmatch(e)]
    problems += _twice(entries)
    indices = [e for e in valid if _INDEX.fullmatch(e)]
    if indices and len(indices) < len(valid):
        problems.append(
            f"mixes GPU indices ({', '.join(indices[:3])}) with UUIDs: one GPU could be in it twice under two "
            "names; use one kind"
        )
    if len(problems) > MAX_PROBLEMS:
        problems[MAX_PROBLEMS - 1 :] = [
            f"has {len(problems) - MAX_PROBLEMS + 1} more problems of these kinds"
        ]
    return problems


def split_gpu_list(raw: str) -> tuple[str, ...]:
    """``raw`` split at commas, blanks stripped; ``""`` (or blanks): no GPU."""
    return tuple(part.strip() for part in raw.split(",")) if raw.strip() else ()


def nvidia_smi_gpus() -> tuple[str, ...] | None:
    """The GPU indices ``nvidia-smi`` lists (within 20 s), or None where it is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def checked_visible_devices(entries: Sequence[str], key: str, source: str) -> tuple[str, ...]:
    """``entries`` when they name distinct GPUs, else :class:`DeploymentConfigError` (one problem per finding,
    each under ``key``, with the list as given)."""
    problems = gpu_list_problems(entries)
    if problems:
        shown = _shown(",".join(entries))
        raise DeploymentConfigError(
            [Problem(key, f"{shown} {problem}") for problem in problems], source=source
        )
    return tuple(entries)


def inherited_visible_devices(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The inherited list (``""``: no GPU at all), or None when the variable is not set;
    :class:`DeploymentConfigError` when it does not name distinct GPUs (see :func:`gpu_list_problems`)."""
    raw = (os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV)
    if raw is None:
        return None
    return checked_visible_devices(
        split_gpu_list(raw), VISIBLE_DEVICES_ENV, "the GPUs this process was given"
    )


def restrict_to_visible(prepared: PreparedDeployment, visible: Sequence[str]) -> PreparedDeployment:
    """``prepared`` with every engine process's ``CUDA_VISIBLE_DEVICES`` taken from ``visible`` (its local ids
    as positions); :class:`DeploymentConfigError` when the plan needs more GPUs than ``visible`` holds."""
    local_ids = {
        (engine.id, process.node_rank): process.local_gpu_ids
        for engine in prepared.plan.engines
        for process in engine.processes
    }
    needed = max((max(ids) + 1 for ids in local_ids.values() if ids), default=0)
    if needed > len(visible):
        beyond = sorted({key[0] for key, ids in local_ids.items() if ids and max(ids) >= len(visible)})
        shown = ",".join(visible) if visible else "none"
        raise DeploymentConfigError(
            [
                Problem(
                    VISIBLE_DEVICES_ENV,
                    f"this launcher may use {len(visible)} GPU(s) ({shown}) but the plan needs local GPUs "
                    f"0..{needed - 1} on a node (engines {', '.join(beyond[:4])}{'…' if len(beyond) > 4 else ''} "
                    "lie beyond); give the job more GPUs or make the deployment smaller",
                )
            ],
            source="the GPUs this process was given",
        )
    engines = tuple(
        dataclasses.replace(
            launch,
            visible_devices=",".join(visible[i] for i in local_ids[(launch.engine_id, launch.node_rank)]),
        )
        for launch in prepared.launch.engines
    )
    return dataclasses.replace(prepared, launch=dataclasses.replace(prepared.launch, engines=engines))
