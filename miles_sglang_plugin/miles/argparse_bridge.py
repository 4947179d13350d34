"""For trainers still on argparse (Miles, slime): their parsed ``Namespace`` → the same frozen plan.

``resolve_namespace(args)`` reads Miles' own argument names (:meth:`TrainerInputs.from_namespace`), Miles'
``--sglang-<field>`` values (:func:`server_defaults_from_namespace`, what ``sglang_deploy.server_defaults`` holds
on the Hydra path) and, when ``args.sglang_config`` is set, the ``--sglang-config`` file (a path or Miles'
``base64:`` form, see :func:`~miles_sglang_plugin.miles.sglang_config.load_miles_config`); without it, Miles'
legacy deployment (``--prefill-num-servers`` or one regular group, plus the ``--eval-num-gpus`` fleet). The plan
equals the one the Hydra path resolves for the same inputs. :func:`lora_from_namespace` maps Miles' LoRA
arguments onto ``sglang_deploy.lora``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, ExternalEngineSpec, ModelSpec
from miles_sglang_plugin.config.schema import LoraConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.miles.sglang_config import load_miles_config
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.launch_specs import PLAN_OWNED_DEFAULTS
from miles_sglang_plugin.rendering.lora import MILES_LORA_ADAPTER_NAME

#: Miles' ``--sglang-*`` flags arrive as ``sglang_<ServerArgs field>``.
SGLANG_PREFIX = "sglang_"
#: ``sglang_<name>`` attributes that are Miles' own arguments, not ServerArgs values (``--sglang-config`` is the
#: deployment file; ServerArgs' own ``config`` is not registered by Miles).
_MILES_OWN_SGLANG_ARGS = frozenset({"config"})


def server_defaults_from_namespace(ns: Any, fields: Collection[str]) -> dict[str, Any]:
    """Miles' ``--sglang-<field>`` values of ``ns`` (those that are set: not None) as ServerArgs field -> value,
    for the ServerArgs ``fields`` of the installed SGLang. Left out, as Miles leaves them out: what the plan
    decides itself (``host``, ``tp_size``, ``random_seed``, ...) and the API keys (secrets, carried apart)."""
    known = frozenset(fields)
    values: dict[str, Any] = {}
    for attribute, value in vars(ns).items():
        if not attribute.startswith(SGLANG_PREFIX) or value is None:
            continue
        name = attribute[len(SGLANG_PREFIX) :]
        if name in known and name not in _MILES_OWN_SGLANG_ARGS and name not in PLAN_OWNED_DEFAULTS:
            values[name] = value
    return values


#: Miles' ``--target-modules all-linear`` (``arguments.py``), for the dense attention and MLP projections; the
#: MLA projections Miles adds for checkpoints whose config has them are not known here (name them instead).
ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _target_modules(value: Any) -> list[str]:
    """Miles' ``--target-modules``: a list (as ``miles_validate_args`` leaves it) or the command-line string
    (``all-linear`` or comma-separated names)."""
    if value is None:
        return []
    if isinstance(value, str):
        if value == "all-linear":
            return list(ALL_LINEAR_MODULES)
        return [name.strip() for name in value.split(",") if name.strip()]
    return [str(name) for name in value]


def lora_from_namespace(ns: Any) -> LoraConf:
    """``sglang_deploy.lora`` from Miles' LoRA arguments (radixark/miles at 31f1ca961): single LoRA when
    ``--lora-rank`` > 0 or ``--lora-adapter-path`` is given, unless ``--lora-train-only``; multi-LoRA with
    ``--multi-lora-n-adapters`` > 0; ``max_lora_rank`` = ``max(--lora-rank, 1)``; the adapter path as
    ``miles_lora`` (single LoRA only); ``--lora-base-cpu-backup``."""
    rank = getattr(ns, "lora_rank", 0) or 0
    adapter = getattr(ns, "lora_adapter_path", None)
    enabled = (rank > 0 or adapter is not None) and not getattr(ns, "lora_train_only", False)
    adapters = getattr(ns, "multi_lora_n_adapters", 0) or 0
    return LoraConf(
        enabled=enabled,
        paths={MILES_LORA_ADAPTER_NAME: adapter} if enabled and adapter is not None and not adapters else {},
        max_lora_rank=max(rank, 1),
        target_modules=_target_modules(getattr(ns, "target_modules", None)),
        multi_lora_n_adapters=adapters,
        base_cpu_backup=bool(getattr(ns, "lora_base_cpu_backup", False)),
    )


def resolve_namespace(ns: Any, *, server_arg_fields: Collection[str] | None = None) -> DeploymentPlan:
    """Resolve the deployment of a Miles/slime ``argparse.Namespace`` (or any object with those attributes).

    Raises :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem: of the
    ``--sglang-config`` file first (they point into it), then of the deployment. ``--sglang-config`` together
    with ``--prefill-num-servers`` is refused, as in Miles; so is either of them with ``--rollout-external``.
    ``server_arg_fields`` (the installed SGLang's ServerArgs fields) turns on the check of override keys; a
    key of the file that this SGLang lacks is then left out with a note, as Miles does.
    """
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields

    trainer = TrainerInputs.from_namespace(ns)
    config = getattr(ns, "sglang_config", None)
    addresses = getattr(ns, "rollout_external_engine_addrs", None) or []
    if getattr(ns, "rollout_external", False) or addresses:
        problems = ProblemCollector("trainer arguments")
        for name, flag in (
            ("sglang_config", "--sglang-config"),
            ("prefill_num_servers", "--prefill-num-servers"),
        ):
            if getattr(ns, name, None) is not None:
                problems.add(
                    name,
                    f"{flag} cannot be combined with --rollout-external: external engines have their own "
                    "topology, there is nothing to deploy",
                )
        if not addresses and not problems:
            problems.add(
                "rollout_external_engine_addrs",
                "--rollout-external needs the engines' addresses (--rollout-external-engine-addrs HOST:PORT ...)",
            )
        problems.raise_if_any()
        # slime and Miles: one model "default" served by the external engines, receiving weight updates
        # (slime's ExternalRolloutServer("default", update_weights=True)); its GPUs are the engines', not the
        # deployment's, so a rollout_num_gpus given for them is not checked against the (empty) groups.
        external = tuple(
            ExternalEngineSpec(url=address, key=f"rollout_external_engine_addrs[{i}]")
            for i, address in enumerate(addresses)
        )
        external_spec = DeploymentSpec(
            models=(ModelSpec("default", (), update_weights=True, key="sglang.default", external=external),),
            source="trainer arguments (--rollout-external-engine-addrs)",
        )
        trainer = dataclasses.replace(trainer, rollout_num_gpus=None)
        return resolve_deployment(external_spec, trainer, server_arg_fields=server_arg_fields)
    spec = load_miles_config(config) if config else None
    fields = server_arg_fields if server_arg_fields is not None else known_server_arg_fields().fields
    return resolve_deployment(
        spec,
        trainer,
        server_arg_fields=server_arg_fields,
        server_defaults=server_defaults_from_namespace(ns, fields),
    )
