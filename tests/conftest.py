"""Shared test helpers."""

from __future__ import annotations

import os
import signal
from typing import Any

# The local backend honours an inherited CUDA_VISIBLE_DEVICES (a scheduler's GPUs): the tests' expected GPU
# pinning is that of a machine whose GPUs are all visible, wherever they run (a GPU node sets the variable).
# Tests of the inherited list set it themselves.
os.environ.pop("CUDA_VISIBLE_DEVICES", None)

import pytest

from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec
from miles_sglang_plugin.engine_env import CUSTOM_ALL_REDUCE_ENV, MILES_ENGINE_ENV
from miles_sglang_plugin.rendering.router_specs import (
    GATEWAY_ENV,
    GATEWAYS,
    gateway_info,
    gateway_installed,
    gateway_version,
)

# Likewise Miles' engine variables: a launcher's own value wins over Miles' default (its rule), and the tests'
# expected environments are those of a launcher that exported none. Tests of that rule pass their own.
for _name in (*MILES_ENGINE_ENV, CUSTOM_ALL_REDUCE_ENV):
    os.environ.pop(_name, None)

#: The gateway the suite's routers run on: ``--gateway`` or ``$MSP_ROUTER_GATEWAY``, else sglang-router (the
#: default dependency). It is what ``sglang_deploy.router.gateway: auto`` (the default) means in every test,
#: subprocesses included, so that installing SMG next to sglang-router changes no test's gateway.
DEFAULT_TEST_GATEWAY = "sglang_router"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gateway",
        choices=GATEWAYS,
        default=None,
        help=f"gateway of the tests' routers (default: ${GATEWAY_ENV}, else {DEFAULT_TEST_GATEWAY})",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Tests end the launchers they start with SIGINT, as a terminal's Ctrl-C does. A suite started with SIGINT
    # ignored (a background job of a non-interactive shell, nohup, some CI agents) would hand SIG_IGN on to
    # every child, and a launcher that ignores SIGINT never stops. A handler is not inherited across exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    gateway = config.getoption("--gateway") or os.environ.get(GATEWAY_ENV) or DEFAULT_TEST_GATEWAY
    if gateway not in GATEWAYS:
        raise pytest.UsageError(f"${GATEWAY_ENV}={gateway!r} is not one of {', '.join(GATEWAYS)}")
    if not gateway_installed(gateway):
        raise pytest.UsageError(
            f"the tests' gateway {gateway} is not installed: {gateway_info(gateway).install}"
        )
    os.environ[GATEWAY_ENV] = gateway


def pytest_report_header(config: pytest.Config) -> str:
    gateway = os.environ[GATEWAY_ENV]
    return f"router gateway: {gateway} ({gateway_info(gateway).distribution} {gateway_version(gateway)})"


@pytest.fixture
def test_gateway() -> str:
    """The gateway this run's routers use (``sglang_router`` or ``smg``)."""
    return os.environ[GATEWAY_ENV]


def group(wt: str, num_gpus: Any, gpe: Any = None, name: str | None = None, **overrides: Any) -> GroupSpec:
    name = name or wt
    return GroupSpec(
        name=name, worker_type=wt, num_gpus=num_gpus, num_gpus_per_engine=gpe, overrides=overrides
    )


def model(
    name: str, *groups: GroupSpec, path: str | None = None, update: bool | None = None, gpe: Any = None
):
    keyed = tuple(
        GroupSpec(
            g.name,
            g.worker_type,
            g.num_gpus,
            g.num_gpus_per_engine,
            g.overrides,
            key=f"sglang.{name}.{g.name}",
        )
        for g in groups
    )
    return ModelSpec(
        name=name,
        groups=keyed,
        model_path=path,
        update_weights=update,
        num_gpus_per_engine=gpe,
        key=f"sglang.{name}",
    )


def spec(*models: ModelSpec) -> DeploymentSpec:
    return DeploymentSpec(models=tuple(models), source="test")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The real-engine lane's measurements (engine start times, memory), where it ran."""
    from tests.real_engine_helpers import MEASUREMENTS

    if MEASUREMENTS:
        terminalreporter.write_sep("-", "real-engine lane: measured")
        for label, value in MEASUREMENTS.items():
            terminalreporter.write_line(f"{label}: {value}")
