"""For trainers still on argparse (Miles, slime): their parsed ``Namespace`` → the same frozen plan.

``resolve_namespace(args)`` reads Miles' own argument names (:meth:`TrainerInputs.from_namespace`) and, when
``args.sglang_config`` is set, the ``--sglang-config`` file (a path or Miles' ``base64:`` form, see
:func:`~miles_sglang_plugin.miles.sglang_config.load_miles_config`); without it, Miles' legacy deployment
(``--prefill-num-servers`` or one regular group, plus the ``--eval-num-gpus`` fleet). The plan equals the one the
Hydra path resolves for the same deployment.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

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
    if getattr(ns, "rollout_external", False):
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
        problems.raise_if_any()
    spec = load_miles_config(config) if config else None
    return resolve_deployment(spec, trainer, server_arg_fields=server_arg_fields)
