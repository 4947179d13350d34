"""For trainers still on argparse (Miles, slime): their parsed ``Namespace`` → the same frozen plan.

``resolve_namespace(args)`` reads Miles' own argument names (:meth:`TrainerInputs.from_namespace`) and, when
``args.sglang_config`` is set, the ``--sglang-config`` file (a path or Miles' ``base64:`` form, see
:func:`~miles_sglang_plugin.miles.sglang_config.load_miles_config`); without it, Miles' legacy deployment
(``--prefill-num-servers`` or one regular group, plus the ``--eval-num-gpus`` fleet). The plan equals the one the
Hydra path resolves for the same deployment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, ExternalEngineSpec, ModelSpec
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.miles.sglang_config import load_miles_config
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment


def resolve_namespace(ns: Any, *, server_arg_fields: Collection[str] | None = None) -> DeploymentPlan:
    """Resolve the deployment of a Miles/slime ``argparse.Namespace`` (or any object with those attributes).

    Raises :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem: of the
    ``--sglang-config`` file first (they point into it), then of the deployment. ``--sglang-config`` together
    with ``--prefill-num-servers`` is refused, as in Miles; so is either of them with ``--rollout-external``.
    """
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
        spec = DeploymentSpec(
            models=(ModelSpec("default", (), update_weights=True, key="sglang.default", external=external),),
            source="trainer arguments (--rollout-external-engine-addrs)",
        )
        trainer = dataclasses.replace(trainer, rollout_num_gpus=None)
        return resolve_deployment(spec, trainer, server_arg_fields=server_arg_fields)
    spec = load_miles_config(config) if config else None
    return resolve_deployment(spec, trainer, server_arg_fields=server_arg_fields)
