"""Port assignment (``rendering/ports.py``) to the exact port: one cursor per host, the ports only a node
rank 0 or a prefill engine takes, the last usable port, a run of ports broken by a port in use, and the
claims a launch keeps and gives back. Expected numbers worked out by hand from the order of assignment:
routers first, then per engine process ``http``, ``nccl`` and, on node rank 0, a ``dist_init`` run of
``DIST_INIT_SPAN + dp_size`` ports, ``engine_info_bootstrap`` and (prefill) ``disaggregation_bootstrap``."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.ports import (
    EnginePorts,
    PortClaims,
    PortExhaustedError,
    RouterPorts,
    assign_ports,
    default_lock_dir,
    port_is_free,
)
from tests.conftest import group, model, spec
from tests.launch_helpers import random_port_base

#: One regular engine of one GPU: 2 router ports + http, nccl, 31 dist-init ports, engine-info bootstrap.
ONE_ENGINE_PORTS = 36


def one_engine_plan():
    return resolve_deployment(
        spec(model("actor", group("regular", 1))), TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True)
    )


def test_each_host_has_its_own_cursor_and_only_rank_0_and_prefill_take_the_extra_ports():
    # Nodes of 8 GPUs: a 16-GPU prefill engine on nodes 0+1, an 8-GPU decode engine on node 2.
    plan = resolve_deployment(
        spec(model("actor", group("prefill", 16, gpe=16), group("decode", 8, gpe=8))),
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
    )
    hosts = {0: "n0", 1: "n1", 2: "n2"}
    ports = assign_ports(plan, host_of_node=hosts.__getitem__, router_host="r", port_base=15000)
    assert ports.routers == {"actor": RouterPorts(http=15000, prometheus=15001)}
    assert ports.engines == {
        ("actor.prefill.0", 0): EnginePorts(
            http=15000,
            nccl=15001,
            dist_init=15002,
            engine_info_bootstrap=15033,
            disaggregation_bootstrap=15034,
        ),
        ("actor.prefill.0", 1): EnginePorts(http=15000, nccl=15001),
        ("actor.decode.0", 0): EnginePorts(
            http=15000, nccl=15001, dist_init=15002, engine_info_bootstrap=15033
        ),
    }


def test_the_last_port_below_port_max_is_used_and_no_further():
    kw = dict(host_of_node=lambda _node: "h", router_host="h")
    ports = assign_ports(one_engine_plan(), port_base=20000, port_max=20000 + ONE_ENGINE_PORTS - 1, **kw)
    assert ports.engines[("actor.regular.0", 0)].engine_info_bootstrap == 20035
    with pytest.raises(PortExhaustedError, match="below 20035"):
        assign_ports(one_engine_plan(), port_base=20000, port_max=20000 + ONE_ENGINE_PORTS - 2, **kw)


def test_port_max_at_the_ephemeral_start_is_lowered_below_it():
    kw = dict(host_of_node=lambda _node: "h", router_host="h", port_max=32768)
    # 36 ports from 32732 end at 32767, the last port below the ephemeral range; from 32733 they would not.
    assert (
        assign_ports(one_engine_plan(), port_base=32732, **kw).engines[("actor.regular.0", 0)].http == 32734
    )
    with pytest.raises(PortExhaustedError, match="below 32768"):
        assign_ports(one_engine_plan(), port_base=32733, **kw)


def _free_run(length: int) -> int:
    """A port base whose next ``length`` ports are free on loopback now."""
    for base in iter(random_port_base, None):
        if all(port_is_free("127.0.0.1", port) for port in range(base, base + length)):
            return base
    raise AssertionError("unreachable")


def test_a_run_broken_by_a_port_in_use_starts_after_it_and_gives_back_its_claims(tmp_path):
    base = _free_run(ONE_ENGINE_PORTS + 10)
    claims = PortClaims(tmp_path)
    with socket.socket() as other_program:
        other_program.bind(("127.0.0.1", base + 10))  # inside the dist-init run, which would start at base+4
        other_program.listen()
        ports = assign_ports(one_engine_plan(), host_of_node=lambda _node: "127.0.0.1", router_host="127.0.0.1",
                             port_base=base, port_max=base + 2000, probe=True, claims=claims)  # fmt: skip
    try:
        assert ports.routers["actor"] == RouterPorts(http=base, prometheus=base + 1)
        assert ports.engines[("actor.regular.0", 0)] == EnginePorts(
            http=base + 2, nccl=base + 3, dist_init=base + 11, engine_info_bootstrap=base + 42
        )
        # Claimed: what was assigned; not base+4..base+9 (the broken run) nor base+10 (in use).
        assigned = {base, base + 1, base + 2, base + 3, *range(base + 11, base + 42), base + 42}
        assert set(claims.fds) == assigned
        other_launch = PortClaims(tmp_path)
        assert all(other_launch.try_claim(port) for port in range(base + 4, base + 11))
        assert not any(other_launch.try_claim(port) for port in sorted(assigned))
        other_launch.release()
    finally:
        claims.release()


def test_a_lock_directory_is_created_with_its_parents(tmp_path):
    claims = PortClaims(tmp_path / "new" / "locks")
    try:
        assert claims.try_claim(20000)
        assert (tmp_path / "new" / "locks" / "20000.lock").is_file()
    finally:
        claims.release()


def test_the_lock_directory_is_per_user_unless_msp_port_lock_dir_says_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("MSP_PORT_LOCK_DIR", raising=False)
    assert default_lock_dir() == Path(tempfile.gettempdir()) / f"miles-sglang-ports-{os.getuid()}"
    monkeypatch.setenv("MSP_PORT_LOCK_DIR", str(tmp_path))
    assert default_lock_dir() == tmp_path


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_port_is_free_on_ipv6_loopback_bare_or_bracketed(host):
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        assert port_is_free(host, taken) is False
    assert port_is_free(host, taken) is True


def test_running_out_of_ports_says_how_many_were_in_use_and_how_many_claimed(tmp_path: Path) -> None:
    from miles_sglang_plugin.rendering.ports import free_port_runs

    base = random_port_base()
    other_launch = PortClaims(tmp_path)
    mine = PortClaims(tmp_path)
    assert other_launch.try_claim(base) and other_launch.try_claim(base + 3)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", base + 1))
        listening.listen()
        # From base: claimed (base), in use (base + 1), base + 2 free but base + 3 claimed; base + 4 leaves
        # too few below the limit.
        with pytest.raises(PortExhaustedError) as info:
            free_port_runs("127.0.0.1", [[3]], port_base=base, port_max=base + 4, claims=mine)
    assert (
        f"no 3 free consecutive port(s) left on 127.0.0.1 from {base} below {base + 5} (1 passed over in use, "
        "2 claimed by other launches); raise sglang_deploy.launch.port_max or lower port_base"
    ) == str(info.value)
    assert mine.fds == {}  # nothing kept of the partial run
    other_launch.release()


def test_port_claims_stay_exclusive_when_their_lock_directory_is_removed(tmp_path: Path) -> None:
    """Issue 23, for ports (the same claims module): a launch coming after ``rm -rf`` of the lock directory
    skips the ports a running launch holds, and the holder goes on claiming in the new directory."""
    import shutil

    base = random_port_base()
    locks = tmp_path / "locks"
    holder = PortClaims(locks)
    assert holder.try_claim(base)
    shutil.rmtree(locks)
    later = PortClaims(locks)
    try:
        assert not later.try_claim(base) and later.unusable is None  # taken, not a broken lock file
        assert later.try_claim(base + 1)
        assert holder.try_claim(base + 2) and holder.replaced == 1 and (locks / f"{base + 2}.lock").is_file()
        holder.release()
        assert later.try_claim(base)
    finally:
        holder.release()
        later.release()


def test_a_relative_lock_directory_stays_where_it_was_when_the_working_directory_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claims check the directory at its path before each use: the path as it was first used, not as a
    later working directory (a Hydra job's own) would read it."""
    (tmp_path / "first").mkdir()
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    base = random_port_base()
    claims = PortClaims(Path("locks"))
    try:
        assert claims.try_claim(base)
        monkeypatch.chdir(tmp_path / "later")
        assert claims.try_claim(base + 1) and claims.replaced == 0
        assert sorted(p.name for p in (tmp_path / "first" / "locks").iterdir()) == [
            f"{base}.lock",
            f"{base + 1}.lock",
        ]
        assert not (tmp_path / "later" / "locks").exists()
    finally:
        claims.release()


def test_a_change_rendered_without_probing_never_hands_out_a_kept_port() -> None:
    """``plan --diff`` and ``apply(dry_run=True)`` render a change without probing: PD prefill 2 + decode 1 at
    port base 21000 (the router takes 21000 and 21001 first), changed to prefill 1 + decode 2. The added
    decode.1 gets none of the ports the kept router and engines hold (before: the router's own 21000)."""
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.rendering.ports import PortAssignment, ports_held
    from miles_sglang_plugin.rendering.prepared import prepare_deployment
    from miles_sglang_plugin.serving import elastic
    from tests.launch_helpers import compose

    def resolved(*extra: str):  # type: ignore[no-untyped-def]
        cfg = compose("sglang=pd", "sglang.actor.num_gpus_per_engine=1", *extra, port_base=21000)
        return resolve_config(cfg), deploy_settings_from_config(cfg)

    plan, settings = resolved("sglang.actor.prefill.num_gpus=2", "sglang.actor.decode.num_gpus=1")
    running = prepare_deployment(plan, settings)
    fresh, new_settings = resolved("sglang.actor.prefill.num_gpus=1", "sglang.actor.decode.num_gpus=2")
    change = elastic.plan_change(
        running,
        fresh,
        lambda p, ports: prepare_deployment(p, new_settings, fixed_ports=ports),
        settings=new_settings,
    )
    assert change.engines("started") == ("actor.decode.1",)
    router = change.prepared.launch.routers[0].spec
    assert (router.port, router.prometheus_port) == (21000, 21001)
    assert change.prepared.ports is not None and running.ports is not None

    def held(ports: PortAssignment, plan, engines: set[str], routers: bool) -> set[int]:  # type: ignore[no-untyped-def]
        only = PortAssignment(
            engines={k: v for k, v in ports.engines.items() if k[0] in engines},
            routers=ports.routers if routers else {},
        )
        return ports_held(only, plan)

    new_ports = held(change.prepared.ports, change.prepared.plan, {"actor.decode.1"}, routers=False)
    kept = held(running.ports, running.plan, {"actor.prefill.0", "actor.decode.0"}, routers=True)
    assert len(new_ports) == 2 + 31 + 1  # http, nccl, the dist_init run of 30 + dp_size 1, engine info
    assert new_ports & kept == set()


def test_ports_held_counts_every_run_of_every_process_and_router() -> None:
    """PD, prefill 1 + decode 1 (TP 1) at port base 21000, unprobed: the router's 2 ports, the prefill engine's
    http, nccl, dist_init run (30 + dp_size 1), engine info and disaggregation bootstrap (35), the decode
    engine's 34: 71 ports, one block from 21000 (nothing else was in the way)."""
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.rendering.ports import ports_held
    from miles_sglang_plugin.rendering.prepared import prepare_deployment
    from tests.launch_helpers import compose

    cfg = compose("sglang=pd", "sglang.actor.num_gpus_per_engine=1", "sglang.actor.prefill.num_gpus=1",
                  "sglang.actor.decode.num_gpus=1", port_base=21000)  # fmt: skip
    prepared = prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg))
    assert prepared.ports is not None
    assert ports_held(prepared.ports, prepared.plan) == set(range(21000, 21071))


def test_the_local_backend_gives_back_exactly_the_claims_of_what_a_change_removed(tmp_path: Path) -> None:
    """Two regular engines (TP 1) shrink to one: after ``release`` the backend holds the claims of the router
    (2) and the kept engine (2 + 31 + 1 = 34), 36 in all, and none of the removed engine's 34."""
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.backends.local import LocalBackend
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.rendering.ports import ports_held
    from miles_sglang_plugin.serving import elastic
    from tests.launch_helpers import compose, random_port_base

    base = random_port_base()

    def resolved(gpus: int):  # type: ignore[no-untyped-def]
        cfg = compose(
            "sglang.actor.num_gpus_per_engine=1", f"sglang.actor.regular.num_gpus={gpus}", port_base=base
        )
        return resolve_config(cfg), deploy_settings_from_config(cfg)

    claims = PortClaims(tmp_path / "locks")
    backend = LocalBackend(claims=claims, visible_devices=[str(g) for g in range(8)])
    try:
        plan, settings = resolved(2)
        before = backend.prepare(plan, settings)
        assert before.ports is not None and len(ports_held(before.ports, before.plan)) == 70
        assert set(claims.fds) == ports_held(before.ports, before.plan)
        fresh, new_settings = resolved(1)
        change = elastic.plan_change(
            before,
            fresh,
            lambda p, ports: backend.prepare(p, new_settings, fixed_ports=ports),
            settings=new_settings,
        )
        assert change.engines("stopped") == ("actor.regular.1",)
        backend.release(before, change.prepared)
        assert change.prepared.ports is not None
        kept = ports_held(change.prepared.ports, change.prepared.plan)
        assert len(kept) == 36
        assert set(claims.fds) == kept
    finally:
        backend.close()
