"""Launch specs: every generated argv is parsed by the real SGLang parser and compared with the plan."""

from __future__ import annotations

import json
import socket
from collections import Counter
from dataclasses import fields as dataclass_fields
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.app.hydra_edge import prepare_from_config, resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.deployment_spec import GroupSpec
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.config.schema import LaunchConf, SGLangDeployConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.masking import mask_argv
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering import sglang_server_args as sglang_parser
from miles_sglang_plugin.rendering.launch_specs import MILES_ENGINE_ENV
from miles_sglang_plugin.rendering.ports import (
    EPHEMERAL_START,
    PortClaims,
    PortExhaustedError,
    assign_ports,
    port_is_free,
)
from miles_sglang_plugin.rendering.prepared import prepare_deployment
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
from miles_sglang_plugin.standin.flags import parse_launch_argv as parse_standin_argv
from tests.conftest import group, model, spec
from tests.test_resolution_properties import aligned_deployments

#: Generated command lines are parsed by the installed SGLang's parser (the test set-up installs it) or,
#: where SGLang cannot be imported, by the stand-in's (the 0.5.23 field list shipped in the package).
HAVE_SGLANG = sglang_parser.server_args_fields() is not None
FIELDS = known_server_arg_fields().fields
PRESETS = ["default", "pd", "actor_ref", "pd_actor_ref", "multi_model", "placeholder", "agentic_32gpu"]
#: The ``pd`` preset with the TP sizes pinned per group (presets leave them to the trainer).
PD_TP_2_4 = (
    "sglang=pd",
    "sglang.actor.prefill.num_gpus_per_engine=2",
    "sglang.actor.decode.num_gpus_per_engine=4",
)


def prepared_for(*overrides: str):
    return prepare_from_config(compose_config(list(overrides)))


def parsed(launch) -> dict:
    """The ServerArgs values of an engine's argv, as the installed SGLang's parser reads them, else as the
    stand-in's parser does (:func:`standin_parsed`)."""
    assert launch.argv[1:3] == ("-m", "sglang.launch_server")
    if HAVE_SGLANG:
        return sglang_parser.parse_launch_argv(launch.argv[3:])
    return standin_parsed(launch.argv[3:])


class StandInParsed(dict):
    """Values of an argv read by the stand-in's parser, which checks every flag name against the shipped 0.5.23
    field list, types the fields the stand-in uses and keeps the others raw. It knows no SGLang defaults:
    a field the argv leaves out is a KeyError that says so."""

    def __missing__(self, key: str):
        raise KeyError(f"{key}: not on the command line, and the stand-in's parser knows no SGLang default")


def _raw_value(values: tuple[str, ...]):
    """A flag's tokens as SGLang's argparse types would make them, for the values used here: a bare flag is
    True, numbers are numbers, several tokens a list (``nargs``), anything else the string itself."""

    def one(token: str):
        try:
            value = json.loads(token)
        except ValueError:
            return token
        return value if isinstance(value, int | float) and not isinstance(value, bool) else token

    if not values:
        return True
    return one(values[0]) if len(values) == 1 else [one(v) for v in values]


def standin_parsed(argv) -> dict:
    args = parse_standin_argv(argv)
    values = StandInParsed(
        {f.name: getattr(args, f.name) for f in dataclass_fields(args) if f.name not in ("extra", "argv")}
    )
    if values["lora_paths"] is not None:
        values["lora_paths"] = list(values["lora_paths"])
    values.update({name: _raw_value(raw) for name, raw in args.extra})
    return values


def check_against_plan(prep) -> None:
    plan, specs = prep.plan, prep.launch
    by_id = {e.id: (m, g, e) for m in plan.models for g in m.groups for e in g.engines}
    assert {e.engine_id for e in specs.engines} == set(by_id)
    ports_per_host: Counter = Counter()
    gpus_per_node: Counter = Counter()
    for launch in specs.engines:
        m, g, e = by_id[launch.engine_id]
        proc = e.processes[launch.node_rank]
        sa = parsed(launch)
        assert sa["model_path"] == m.model_path
        assert sa["tp_size"] * sa["pp_size"] == g.num_gpus_per_engine
        assert (sa["nnodes"], sa["node_rank"]) == (e.nnodes, proc.node_rank)
        assert sa["base_gpu_id"] == 0 and sa["gpu_id_step"] == 1
        assert launch.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, proc.local_gpu_ids))
        assert (sa["host"], sa["port"]) == (launch.host, launch.port)
        assert sa["disaggregation_mode"] == (g.worker_type.value if g.worker_type.is_pd else "null")
        if g.worker_type.value == "prefill":
            assert sa["disaggregation_bootstrap_port"] == launch.bootstrap_port
            if launch.node_rank == 0:  # the bootstrap server runs on an engine's first node
                ports_per_host[(launch.host, sa["disaggregation_bootstrap_port"])] += 1
        expected_saver = g.overrides.get("enable_memory_saver", plan.trainer.offload_rollout)
        assert sa["enable_memory_saver"] is bool(expected_saver)
        for key, value in g.overrides.items():
            assert sa[key] == value, key
        assert (sa["tp_size"], sa["pp_size"], sa["dp_size"]) == (g.tp_size, g.pp_size, g.dp_size)
        assert sa["random_seed"] == plan.trainer.seed + proc.rank
        # Miles' colocate defaults, below every other layer.
        assert all(sa[k] == g.overrides.get(k, v) for k, v in plan.derived_server_defaults.items())
        assert sa["api_key"] is None and "--api-key" not in launch.argv  # no key configured: none passed
        first = next(x for x in specs.for_engine(e.id) if x.node_rank == 0)
        assert sa["dist_init_addr"] == parsed(first)["dist_init_addr"]
        for port in (sa["port"], sa["nccl_port"]):
            ports_per_host[(launch.host, port)] += 1
        if launch.node_rank == 0:  # the dist-init run (30 + dp_size ports) and the engine-info port
            dist_port = int(sa["dist_init_addr"].rsplit(":", 1)[1])
            for port in range(dist_port, dist_port + 30 + g.dp_size):
                ports_per_host[(launch.host, port)] += 1
            ports_per_host[(launch.host, sa["engine_info_bootstrap_port"])] += 1
        for gpu in proc.local_gpu_ids:
            gpus_per_node[(proc.node, gpu)] += 1
    for r in specs.routers:
        ports_per_host[(r.spec.host, r.spec.port)] += 1
        ports_per_host[(r.spec.host, r.spec.prometheus_port)] += 1
    assert max(ports_per_host.values()) == 1, "a port is used twice on one host"
    assert max(gpus_per_node.values(), default=1) == 1, "a GPU is pinned twice on one node"
    assert all(p < EPHEMERAL_START for _, p in ports_per_host)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_renders_argv_that_real_sglang_parses(preset):
    # Not colocated: rollout after the 8 actor GPUs, so no group needs offload and each gets the saver off.
    prep = prepared_for(f"sglang={preset}", "hf_checkpoint=/ckpt", "offload_rollout=true")
    check_against_plan(prep)
    assert prep.launch.engines


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=st.data())
def test_random_deployments_render_and_parse(data):  # 10 checked examples (discarded ones do not count)
    gpn = data.draw(st.sampled_from([4, 8]))
    spec_ = data.draw(aligned_deployments(gpn))
    extra = {
        "mem_fraction_static": data.draw(st.sampled_from([0.5, 0.85])),
        "chunked_prefill_size": data.draw(st.sampled_from([2048, 8192])),
    }
    models = tuple(
        replace(m, groups=tuple(replace(g, overrides={**g.overrides, **extra}) for g in m.groups))
        for m in spec_.models
    )
    total = sum(g.num_gpus for m in spec_.models for g in m.groups)  # whole nodes: colocated with the actor
    t = TrainerInputs(
        hf_checkpoint="/ckpt",
        num_gpus_per_node=gpn,
        actor_num_nodes=total // gpn,
        actor_num_gpus_per_node=gpn,
        colocate=True,
        offload_rollout=data.draw(st.sampled_from([None, True, False])),
    )
    plan = resolve_deployment(replace(spec_, models=models), t, server_arg_fields=FIELDS)
    assume(len(plan.engines) <= 12)  # keep the parser's work per example small
    check_against_plan(prepare_deployment(plan, SGLangDeployConf(), server_arg_fields=FIELDS))


def test_multi_node_engine_one_process_per_node_with_one_dist_init_addr():
    prep = prepared_for("sglang=default", "sglang.actor.regular.num_gpus=32", "sglang.actor.num_gpus_per_engine=16",
                        "hf_checkpoint=/c", "debug_rollout_only=true")  # fmt: skip
    check_against_plan(prep)
    procs = prep.launch.for_engine("actor.regular.1")
    assert [(p.node, p.node_rank, p.nnodes) for p in procs] == [(2, 0, 2), (3, 1, 2)]
    args = [parsed(p) for p in procs]
    assert args[0]["dist_init_addr"] == args[1]["dist_init_addr"]
    assert [a["tp_size"] for a in args] == [16, 16]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["0,1,2,3,4,5,6,7"] * 2
    assert [w.url for w in prep.launch.router("actor").workers] == [
        prep.launch.for_engine(f"actor.regular.{i}")[0].url for i in (0, 1)
    ]  # only node rank 0 registers with the router


def test_precedence_overrides_then_derived_then_server_defaults():
    s = spec(
        model("actor", group("prefill", 2, gpe=2), group("prefill", 2, gpe=2, name="p2", load_balance_method="follow_bootstrap_room"),
              group("decode", 2, gpe=2, mem_fraction_static=0.9)),
    )  # fmt: skip
    plan = resolve_deployment(s, TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True))
    conf = SGLangDeployConf(server_defaults={"mem_fraction_static": 0.7, "enable_hierarchical_cache": True,
                                             "load_balance_method": "total_requests"})  # fmt: skip
    prep = prepare_deployment(plan, conf, server_arg_fields=FIELDS)
    prefill, p2, decode = (
        prep.launch.for_engine(f"actor.{g}.0")[0].server_args for g in ("prefill", "p2", "decode")
    )
    assert (
        prefill["load_balance_method"] == "round_robin"
    )  # Miles' prefill value beats the deployment default
    assert p2["load_balance_method"] == "follow_bootstrap_room"  # a group override beats both
    assert decode["load_balance_method"] == "total_requests"  # nothing derived for decode: the default
    assert prefill["mem_fraction_static"] == 0.7 and decode["mem_fraction_static"] == 0.9
    assert prefill["enable_hierarchical_cache"] is True and "enable_hierarchical_cache" not in decode
    assert "prefill_round_robin_balance" not in decode  # not a field of SGLang 0.5.23
    assert any("prefill_round_robin_balance" in n for n in prep.launch.notes)


def test_server_defaults_may_not_set_what_the_plan_derives():
    plan = resolve_deployment(
        spec(model("actor", group("regular", 2))), TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True)
    )
    conf = SGLangDeployConf(
        server_defaults={"skip_server_warmup": False, "enable_memory_saver": True, "api_key": "k"}
    )
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(plan, conf, server_arg_fields=FIELDS)
    text = str(exc.value)
    assert (
        "sglang_deploy.server_defaults.skip_server_warmup: cannot be set deployment-wide: always on" in text
    )
    assert "sglang_deploy.server_defaults.enable_memory_saver: cannot be set deployment-wide" in text
    assert "sglang_deploy.server_defaults.api_key: cannot be set deployment-wide: it is a secret" in text


def test_env_defaults_user_env_and_gpu_pinning():
    plan = resolve_deployment(
        spec(model("actor", group("regular", 4, gpe=2))),
        TrainerInputs(hf_checkpoint="/c", colocate=True, actor_num_gpus_per_node=4),
    )
    conf = SGLangDeployConf(
        env={"SGLANG_JIT_DEEPGEMM_PRECOMPILE": "true", "CUDA_VISIBLE_DEVICES": "7", "X": "1"}
    )
    e0, e1 = prepare_deployment(plan, conf).launch.engines
    assert e1.env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the plan's GPUs, never the user's
    assert e0.env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "true" and e0.env["X"] == "1"
    assert e0.env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == "0"  # colocated and TP > 1
    assert {
        k: v for k, v in e0.env.items() if k in MILES_ENGINE_ENV and k != "SGLANG_JIT_DEEPGEMM_PRECOMPILE"
    } == {k: v for k, v in MILES_ENGINE_ENV.items() if k != "SGLANG_JIT_DEEPGEMM_PRECOMPILE"}


def test_api_key_is_passed_but_never_shown():
    cfg = compose_config(["sglang=pd", "hf_checkpoint=/c", "sglang_deploy.api_key=s3cr3t-key"])
    prep = prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg))
    e = prep.launch.engines[0]
    assert e.argv[e.argv.index("--api-key") + 1] == "s3cr3t-key"
    assert "s3cr3t-key" not in e.display_command() and "'***'" in e.display_command()
    assert "s3cr3t-key" not in json.dumps(prep.to_dict())
    assert "s3cr3t-key" not in repr(prep.launch.routers[0].spec)
    assert prep.launch.routers[0].spec.api_key == "s3cr3t-key"
    assert mask_argv(["--api-key=abc", "--x"]) == ["--api-key=***", "--x"]


ADMIN_KEYS = ("adm1n-spaced key", "adm1n-equals", "adm1n-under")
#: ``--admin-api-key`` can reach an engine's argv only through the command prefix; every spelling is masked.
ADMIN_PREFIX = (
    f"sglang_deploy.launch.command=['{{python}}',-m,sglang.launch_server,--admin-api-key,'{ADMIN_KEYS[0]}',"
    f"'--admin-api-key={ADMIN_KEYS[1]}',--admin_api_key,{ADMIN_KEYS[2]}]"
)


def test_admin_api_key_is_masked_in_printed_commands_plan_json_and_errors(capsys):
    from miles_sglang_plugin.cli import main

    base = ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=1", ADMIN_PREFIX]
    assert main(["plan", "--commands", *base]) == 0
    printed = capsys.readouterr().out
    assert "--admin-api-key '***' '--admin-api-key=***' --admin_api_key '***' --model-path /c" in printed
    assert main(["plan", "--json", *base]) == 0
    printed_json = capsys.readouterr().out
    (launch,) = json.loads(printed_json)["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"]
    assert launch["argv"][1:9] == [
        "-m", "sglang.launch_server", "--admin-api-key", "***", "--admin-api-key=***", "--admin_api_key", "***",
        "--model-path",
    ]  # fmt: skip
    prep = prepared_for(*base)
    assert prep.launch.engines[0].argv[4] == ADMIN_KEYS[0]  # the engine itself gets the key
    for text in (printed, printed_json, repr(prep), repr(prep.launch.engines[0])):
        assert not any(key in text for key in ADMIN_KEYS)
    assert main(["plan", *base, "+sglang.actor.regular.overrides.admin_api_key=adm1n-override"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "sglang.actor.regular.overrides.admin_api_key: cannot be overridden (***): it is a secret" in err
    assert "adm1n-override" not in err


def test_typo_and_forbidden_overrides_fail_before_launch_with_reasons():
    with pytest.raises(DeploymentConfigError) as exc:
        prepared_for(*PD_TP_2_4, "hf_checkpoint=/c", "+sglang.actor.decode.overrides.mem_fraction_statc=0.8",
                     "+sglang.actor.prefill.overrides.base_gpu_id=2", "+sglang.actor.prefill.overrides.tp_size=4",
                     "+sglang_deploy.server_defaults.nnodes=2", "+sglang_deploy.server_defaults.chunk_prefill_size=1")  # fmt: skip
    text = " ".join(str(exc.value).split())
    assert (
        "sglang.actor.decode.overrides.mem_fraction_statc: is not a ServerArgs field of the installed SGLang; did you mean mem_fraction_static?"
        in text
    )
    assert (
        "sglang.actor.prefill.overrides.base_gpu_id: cannot be overridden (2): each engine sees only its own GPUs"
        in text
    )
    assert "sglang.actor.prefill.overrides.tp_size: 4 disagrees with num_gpus_per_engine=2" in text
    # deployment-wide defaults are checked in a second pass, once the deployment itself resolves
    with pytest.raises(DeploymentConfigError) as exc:
        prepared_for("sglang=pd", "hf_checkpoint=/c", "+sglang_deploy.server_defaults.nnodes=2",
                     "+sglang_deploy.server_defaults.chunk_prefill_size=1")  # fmt: skip
    text = " ".join(str(exc.value).split())
    assert "sglang_deploy.server_defaults.nnodes: cannot be set deployment-wide" in text
    assert "did you mean chunked_prefill_size?" in text


def test_bootstrap_ports_are_distinct_per_prefill_engine():
    prep = prepared_for(*PD_TP_2_4, "hf_checkpoint=/c")
    boots = [e.bootstrap_port for e in prep.launch.engines if e.worker_type.value == "prefill"]
    assert len(boots) == 2 and len(set(boots)) == 2
    workers = prep.launch.router("actor").workers
    assert [(w.worker_type, w.bootstrap_port) for w in workers][:2] == [
        ("prefill", boots[0]),
        ("prefill", boots[1]),
    ]


# ---------------------------------------------------------------------------------------------- ports
def _plan():
    return resolve_deployment(
        spec(model("actor", group("regular", 4, gpe=1))),
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
    )


def bind_in_range(sock: socket.socket, lo: int, hi: int) -> int:
    """Bind ``sock`` on loopback to a free port in [lo, hi) (port 0 would give an ephemeral one)."""
    import random

    for port in random.sample(range(lo, hi), 200):
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        sock.listen()
        return port
    raise RuntimeError("no free port")


def test_ports_skip_a_port_taken_by_another_program():
    with socket.socket() as s:
        taken = bind_in_range(s, 20000, 30000)
        ports = assign_ports(_plan(), host_of_node=lambda n: "127.0.0.1", router_host="127.0.0.1",
                             port_base=taken, port_max=taken + 2000, probe=True)  # fmt: skip
        assert ports.routers["actor"].http == taken + 1


def test_ports_of_concurrent_launches_never_overlap(tmp_path):
    a, b = PortClaims(tmp_path), PortClaims(tmp_path)
    base = 20000 + (hash(str(tmp_path)) % 5000)
    kw = dict(host_of_node=lambda n: "127.0.0.1", router_host="127.0.0.1", port_base=base, probe=True)
    pa = assign_ports(_plan(), claims=a, **kw)
    pb = assign_ports(_plan(), claims=b, **kw)
    used_a = set(a.fds)
    used_b = set(b.fds)
    assert used_a and used_b and not (used_a & used_b)
    assert pb.routers["actor"].http > max(used_a) or pb.routers["actor"].http not in used_a
    a.release()
    c = PortClaims(tmp_path)
    assign_ports(_plan(), claims=c, **kw)
    assert set(c.fds) == used_a  # released claims are reused
    b.release()
    c.release()
    assert pa.routers["actor"].http == base


def _lock_files(lock_dir) -> set[int]:
    return {int(f.name.removesuffix(".lock")) for f in lock_dir.iterdir()}


def test_launches_share_port_claims_only_through_one_lock_dir(tmp_path, monkeypatch):
    from miles_sglang_plugin.backends.local import LocalBackend
    from tests.launch_helpers import compose, launch_ports

    cfg = compose("sglang.actor.regular.num_gpus=2")  # a random port_base in 20000-29600
    plan, settings = resolve_config(cfg), deploy_settings_from_config(cfg)
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    backends = []

    def launch_in(lock_dir):
        monkeypatch.setenv("MSP_PORT_LOCK_DIR", str(lock_dir))
        backends.append(LocalBackend())
        return backends[-1].prepare(plan, settings)

    try:
        first = launch_in(dir_a)
        claimed = set(backends[0].claims.fds)
        assert backends[0].claims.lock_dir == dir_a
        assert launch_ports(first) <= claimed <= _lock_files(dir_a)
        # Any other lock file is of a port given back (a run broken by a port another program holds, as on a
        # loaded machine): unlocked.
        given_back = PortClaims(dir_a)
        assert all(given_back.try_claim(port) for port in _lock_files(dir_a) - claimed)
        given_back.release()
        assert not any(PortClaims(dir_a).try_claim(port) for port in claimed)  # held while the launch runs
        second = launch_in(dir_a)  # the same directory: it keeps off the first launch's ports
        assert not set(backends[1].claims.fds) & claimed
        assert not launch_ports(second) & launch_ports(first)
        elsewhere = launch_in(dir_b)  # another directory: the first launch's claims are not seen there, so it
        # takes the same ports (all of them, unless another program took one meanwhile: then it skips that one)
        reused = set(backends[2].claims.fds)
        assert reused & claimed and len(reused & claimed) >= len(claimed) - 2
        assert launch_ports(elsewhere) <= reused <= _lock_files(dir_b)
    finally:
        for backend in backends:
            backend.close()
    again = PortClaims(dir_a)
    assert all(again.try_claim(port) for port in claimed)  # released when the launch closes
    again.release()


def test_a_lock_file_that_cannot_be_opened_makes_its_port_taken(tmp_path):
    from tests.launch_helpers import random_port_base

    base = next(
        b
        for b in iter(random_port_base, None)
        if port_is_free("127.0.0.1", b) and port_is_free("127.0.0.1", b + 1)
    )
    (tmp_path / f"{base}.lock").mkdir()  # os.open fails on it (EISDIR), whoever runs the test
    claims = PortClaims(tmp_path)
    ports = assign_ports(_plan(), host_of_node=lambda n: "127.0.0.1", router_host="127.0.0.1",
                         port_base=base, port_max=base + 2000, probe=True, claims=claims)  # fmt: skip
    assert ports.routers["actor"].http == base + 1 and base not in claims.fds
    claims.release()


def test_an_unusable_lock_dir_fails_the_launch_saying_why(tmp_path, monkeypatch, capsys):
    from miles_sglang_plugin.backends.local import LocalBackend
    from miles_sglang_plugin.cli import main
    from tests.launch_helpers import launch_overrides

    (tmp_path / "file").write_text("")
    lock_dir = tmp_path / "file" / "locks"  # cannot be created, whoever runs the test (root included)
    monkeypatch.setenv("MSP_PORT_LOCK_DIR", str(lock_dir))
    overrides = launch_overrides("sglang.actor.regular.num_gpus=1")
    cfg = compose_config(overrides)
    with pytest.raises(DeploymentConfigError) as exc:
        LocalBackend().prepare(resolve_config(cfg), deploy_settings_from_config(cfg))
    text = " ".join(str(exc.value).split())
    assert f"no port on 127.0.0.1 could be claimed: the port lock directory {lock_dir} is not usable" in text
    assert "Not a directory" in text and "set MSP_PORT_LOCK_DIR to a writable directory" in text
    logs = tmp_path / "logs"
    assert main(["launch", "--log-dir", str(logs), *overrides]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"the port lock directory {lock_dir} is not usable" in err and "Traceback" not in err
    assert not logs.exists()  # nothing was started


def test_ports_stay_below_the_ephemeral_range():
    kw = dict(host_of_node=lambda n: "h", router_host="h", port_max=65000)
    ports = assign_ports(_plan(), port_base=32000, **kw)
    all_ports = [p for ep in ports.engines.values() for p in (ep.http, ep.nccl)]
    assert max(all_ports) < EPHEMERAL_START
    with pytest.raises(PortExhaustedError, match="below 32768"):
        assign_ports(_plan(), port_base=32700, **kw)
    assert LaunchConf().port_max == EPHEMERAL_START - 1


def test_group_spec_keeps_overrides_read_only():
    g = GroupSpec("regular", "regular", 2, overrides={"a": [1]})
    with pytest.raises(TypeError, match="does not support item assignment"):
        g.overrides["a"] = 2  # type: ignore[index]


def test_lora_replay_fp16_and_command_prefix_render_for_real_sglang(tmp_path):
    adapter = tmp_path / "a"  # an adapter SGLang can load at start (a rollout-only run preloads it)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    prep = prepared_for(
        "sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=2",
        "use_rollout_routing_replay=true", "fp16=true", "sglang_deploy.lora.enabled=true",
        f"+sglang_deploy.lora.paths.miles_lora={adapter}", "sglang_deploy.lora.max_loras_per_batch=2",
        "sglang_deploy.lora.target_modules=[q_proj,v_proj]", "+sglang_deploy.server_defaults.mem_fraction_static=0.6",
    )  # fmt: skip
    sa = parsed(prep.launch.engines[0])
    assert sa["enable_lora"] is True and sa["lora_paths"] == [f"miles_lora={adapter}"]
    assert (sa["max_loras_per_batch"], sa["max_lora_rank"]) == (2, 8)
    assert sa["lora_target_modules"] == ["q_proj", "v_proj"]
    assert sa["enable_return_routed_experts"] is True and sa["dtype"] == "float16"
    assert sa["mem_fraction_static"] == 0.6
    serve = prepared_for(
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy.launch.command=[sglang,serve]",
    )
    assert serve.launch.engines[0].argv[:2] == ("sglang", "serve")


def test_standin_choice_and_fault_env_are_explicit():
    prep = prepared_for(*PD_TP_2_4, "hf_checkpoint=/c", "debug_rollout_only=true", "sglang_deploy=simulated",
                        "sglang_deploy.standin.fail_at_start=[actor.decode.*]", "+sglang_deploy.standin.die_after_s={actor.prefill.1: 2.5}")  # fmt: skip
    assert all(e.argv[1:3] == ("-m", "miles_sglang_plugin.standin") for e in prep.launch.engines)
    env = {e.engine_id: e.env for e in prep.launch.engines}
    assert [k for k, v in env.items() if v.get("MSP_STANDIN_FAIL_AT_START") == "1"] == [
        "actor.decode.0", "actor.decode.1", "actor.decode.2",
    ]  # fmt: skip
    assert (
        env["actor.prefill.1"]["MSP_STANDIN_DIE_AFTER_S"] == "2.5"
        and "MSP_STANDIN_DIE_AFTER_S" not in env["actor.prefill.0"]
    )
    real = prepared_for(
        "sglang=pd",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy.standin.fail_at_start=[actor.*]",
    )
    assert all(not any(k.startswith("MSP_STANDIN") for k in e.env) for e in real.launch.engines)


def test_local_backend_refuses_multi_node_plans_of_real_engines_before_starting_anything(tmp_path):
    from miles_sglang_plugin.backends.base import UnsupportedPlanError
    from miles_sglang_plugin.backends.local import LocalBackend

    wide = prepared_for("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
                        "sglang.actor.num_gpus_per_engine=16")  # fmt: skip
    with pytest.raises(UnsupportedPlanError) as exc:
        LocalBackend().check(wide)
    assert "engine(s) actor.regular.0 span several nodes" in str(exc.value)
    spread = prepared_for("sglang=pd_actor_ref", "hf_checkpoint=/c")  # rollout on nodes 1-3, after the actor
    with pytest.raises(UnsupportedPlanError) as exc:
        LocalBackend().check(spread)
    assert "the plan places engines on 3 nodes (1, 2, 3)" in str(exc.value)
    assert not any(tmp_path.iterdir())  # nothing was started, not even a log file
    one_node = prepared_for("sglang=pd_actor_ref", "hf_checkpoint=/c", "debug_rollout_only=true",
                            "sglang.actor.prefill.num_gpus=4", "sglang.actor.decode.num_gpus=4", "~sglang.ref")  # fmt: skip
    assert LocalBackend().check(one_node) == []


def test_deployment_wide_dp_and_pp_sizes_shape_engines_and_ports():
    prep = prepared_for("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=8",
                        "sglang.actor.num_gpus_per_engine=4", "+sglang_deploy.server_defaults.dp_size=4",
                        "+sglang_deploy.server_defaults.enable_dp_attention=true",
                        "+sglang_deploy.server_defaults.pp_size=2")  # fmt: skip
    g = prep.plan.model("actor").groups[0]
    assert (g.tp_size, g.pp_size, g.dp_size) == (2, 2, 4)
    check_against_plan(prep)  # includes: the 34-port dist-init runs of the two engines do not overlap
    with pytest.raises(DeploymentConfigError) as exc:
        prepared_for("sglang=default", "hf_checkpoint=/c", "sglang.actor.num_gpus_per_engine=4",
                     "+sglang_deploy.server_defaults.pp_size=3")  # fmt: skip
    assert "sglang_deploy.server_defaults.pp_size: 3 does not divide num_gpus_per_engine=4" in str(exc.value)


def test_ipv6_host_renders_bracketed_addresses_that_sglang_accepts():
    # One 16-GPU node: where a plan spreads real engines over several nodes, the addresses are the nodes'
    # (shown as <node N address>), not launch.host.
    one_node = ("sglang=pd", "hf_checkpoint=/c", "debug_rollout_only=true", "num_gpus_per_node=16")
    prep = prepared_for(*one_node, "sglang_deploy.launch.host='[::1]'")
    check_against_plan(prep)
    bare = prepared_for(*one_node, "sglang_deploy.launch.host='::1'")
    assert [e.argv for e in bare.launch.engines] == [e.argv for e in prep.launch.engines]
    e = prep.launch.engines[0]
    sa = parsed(e)
    assert sa["host"] == "::1" and sa["dist_init_addr"].startswith("[::1]:")
    assert e.url == f"http://[::1]:{e.port}"
    assert prep.launch.routers[0].spec.url.startswith("http://[::1]:")


def test_eval_overrides_and_api_key_overrides_are_checked():
    with pytest.raises(DeploymentConfigError) as exc:
        prepared_for("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "eval_num_gpus=2",
                     "+sglang_model@sglang.eval=base", "sglang.eval.regular.num_gpus=2",
                     "+eval_sglang_overrides.port=1", "+eval_sglang_overrides.mem_fraction_statc=0.5",
                     "+sglang.actor.regular.overrides.api_key=hunter2")  # fmt: skip
    text = " ".join(str(exc.value).split())
    assert "eval_sglang_overrides.port: cannot be overridden (1)" in text
    assert "eval_sglang_overrides.mem_fraction_statc: is not a ServerArgs field" in text
    assert "sglang.actor.regular.overrides.api_key: cannot be overridden (***): it is a secret" in text
    assert "hunter2" not in text
    assert text.count("eval_sglang_overrides.port") == 1  # once, not once per eval group


def test_secrets_stay_out_of_reprs_and_printed_environments():
    cfg = compose_config(["sglang=pd", "hf_checkpoint=/c", "sglang_deploy.api_key=s3cr3t",
                          "+sglang_deploy.env.HF_TOKEN=tok123"])  # fmt: skip
    prep = prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg))
    for text in (repr(prep), repr(prep.settings), repr(prep.launch.engines[0]), json.dumps(prep.to_dict())):
        assert "s3cr3t" not in text and "tok123" not in text
    assert prep.launch.engines[0].env["HF_TOKEN"] == "tok123"  # the engine still gets it
