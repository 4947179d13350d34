"""Issue 12 at the config edge: bad input is one clean error (exit 2, no traceback, nothing started) in
``miles-sglang`` and in a Hydra app using the group (``tests/trainer_app``); keys a typed node does not know
are errors; interpolations in ``sglang_deploy`` resolve in place; ``plan``, ``resolve_config`` and a launch
share one check; a Ctrl-C while the command loads is one line. Also: every schema field has a docstring, the
start-up display's ``never`` mode, the launcher's own HTTP requests kept out of the app's log."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from miles_sglang_plugin.app import hydra_edge
from miles_sglang_plugin.app.hydra_edge import launch_from_config, prepare_from_config, resolve_config
from miles_sglang_plugin.cli import main
from miles_sglang_plugin.config import schema
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.field_docs import field_docs
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError

APP = Path(__file__).resolve().parent / "trainer_app"
LONG = "m" * 300


def plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    captured = capsys.readouterr()
    return rc, captured.out, " ".join(captured.err.split())


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    target = tmp_path / "trainer_app"
    shutil.copytree(APP, target, ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun"))
    return target


def run_app(app_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=app_dir, capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------------------- (a) Hydra's own tracebacks
BAD_OVERRIDES = {
    "sglang=null": "sglang=null: sglang is a config group: its value must be a preset name (this package's: "
    "actor_ref, actor_ref_1node, agentic_32gpu, default, multi_model, pd, pd_actor_ref, pd_actor_ref_1node, "
    "placeholder; or one of the app's), not "
    "null; ~sglang removes it",
    "sglang_deploy=null": "sglang_deploy=null: sglang_deploy is a config group: its value must be default, "
    "simulated or cpu_sglang, not null; ~sglang_deploy removes it",
    f"+sglang.{LONG}.regular.num_gpus=1": "(327 characters): a key or name of 324 bytes; at most 200 (Hydra "
    "looks keys and option names up as file names)",
    "+sglang_model=base": "+sglang_model=base: sglang_model is a helper group, used only at a package: add a "
    "model with +sglang_model@sglang.<name>=base",
}


@pytest.mark.parametrize("override", sorted(BAD_OVERRIDES))
def test_overrides_hydra_would_crash_on_are_clean_errors_in_plan(capsys, override: str):
    rc, out, err = plan_cli(capsys, "hf_checkpoint=/c", override)
    assert (rc, out) == (2, "")
    assert err.startswith("error: 1 bad override: - ") and BAD_OVERRIDES[override] in err


def test_a_model_name_too_long_for_file_names_is_refused_when_read(capsys):
    name = "m" * 100  # a key of 126 bytes: Hydra can look it up; the name is still too long for log files
    rc, _, err = plan_cli(
        capsys, "hf_checkpoint=/c", f"+sglang_model@sglang.{name}=base", f"sglang.{name}.regular.num_gpus=1"
    )
    assert rc == 2
    assert f"sglang.{'m' * 24}…: the model name is 100 characters long; at most 64" in err


def test_the_same_overrides_in_a_subprocess_and_a_sweep(tmp_path: Path):
    for args in (["sglang=null"], [f"+sglang.{LONG}.regular.num_gpus=1"]):
        proc = subprocess.run(
            [sys.executable, "-m", "miles_sglang_plugin", "plan", *args],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("error: 1 bad override:")


@pytest.mark.parametrize(
    "override",
    [
        "sglang@actor_rollout_ref.rollout.engines=null",
        "sglang_deploy=null",
        f"+sglang.{LONG}=1",
        "+sglang_model=base",
    ],
)
def test_in_a_hydra_app_they_exit_2_before_anything_runs(app_dir: Path, override: str):
    proc = run_app(app_dir, override)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: 1 bad override:")
    assert proc.stdout == "" and not (app_dir / "outputs").exists()  # the task never ran


def test_in_a_sweep_of_a_hydra_app_every_value_is_checked_first(app_dir: Path):
    proc = run_app(app_dir, "-m", "sglang@actor_rollout_ref.rollout.engines=pd,null")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sglang@actor_rollout_ref.rollout.engines=pd,null: sglang is a config group" in proc.stderr
    assert not (app_dir / "multirun").exists()


# ------------------------------------------------------------------------------ (b) keys that vanish
VANISHING = {
    "+sglang.actor.regular.num_gpu=4": "sglang.actor.regular.num_gpu: is not a field of ServerGroupConf (a '+' "
    "override adds any key; this one would be ignored); did you mean num_gpus?",
    "+sglang_deploy.launch.port_bas=20000": "sglang_deploy.launch.port_bas: is not a field of LaunchConf (a '+' "
    "override adds any key; this one would be ignored); did you mean port_base, port_max?",
    "+foo=1": "foo: is not a field of MilesTrainerArgs (a '+' override adds any key; this one would be "
    "ignored); miles-sglang fields lists its fields",
    "+sglang.actor.model_pth=/x": "sglang.actor.model_pth: is not a field of ModelConf",
    "+sglang_deploy.router.polcy=round_robin": "sglang_deploy.router.polcy: is not a field of RouterConf (a '+' "
    "override adds any key; this one would be ignored); did you mean policy?",
}


@pytest.mark.parametrize("override", sorted(VANISHING))
def test_a_key_a_typed_node_does_not_know_is_an_error(capsys, override: str):
    rc, _, err = plan_cli(capsys, "hf_checkpoint=/c", override)
    assert rc == 2
    assert "1 problem with the SGLang deployment" in err and VANISHING[override] in err


def test_a_typed_extra_group_is_checked_too(capsys):
    rc, _, err = plan_cli(
        capsys, "sglang=pd", "hf_checkpoint=/c", "+sglang_group@sglang.actor.extra_groups.d8=decode",
        "+sglang.actor.extra_groups.d8.num_gpu=8",
    )  # fmt: skip
    assert rc == 2
    assert "sglang.actor.extra_groups.d8.num_gpu: is not a field of ExtraServerGroupConf" in err


def test_free_form_maps_and_an_untyped_roots_own_keys_take_new_keys():
    plan = resolve_config(
        compose_config(
            ["hf_checkpoint=/c", "+sglang.actor.regular.overrides.mem_fraction_static=0.8",
             "+sglang_deploy.env.MY_VAR=1", "+sglang_deploy.server_defaults.chunked_prefill_size=4096",
             "+sglang_deploy.lora.paths.a=/adapters/a", "+sglang_deploy.router.extra.max_payload_size=1024"]
        )
    )  # fmt: skip
    assert plan.model("actor").group("regular").overrides["mem_fraction_static"] == 0.8
    app_cfg = compose_config(
        ["+foo=1", "+trainer.foo=2"], "ppo_trainer", config_dir=APP / "config", return_hydra_config=True
    )
    assert resolve_config(app_cfg).total_gpus == 32  # the app's own keys, under an untyped root


def test_launch_refuses_a_vanishing_key_before_the_backend_is_reached(monkeypatch):
    def no_backend(name):
        raise AssertionError("the launch went past the checks")

    monkeypatch.setattr(hydra_edge, "get_backend", no_backend)
    cfg = compose_config(["hf_checkpoint=/c", "sglang_deploy=simulated", "+sglang.actor.regular.num_gpu=2"])
    with pytest.raises(DeploymentConfigError, match=r"sglang\.actor\.regular\.num_gpu: is not a field"):  # noqa: SIM117
        with launch_from_config(cfg):
            pass


# ------------------------------------------------------------------------- (c) interpolations in place
def test_sglang_deploy_interpolates_other_nodes_in_place(capsys):
    rc = main(["plan", "--json", "hf_checkpoint=/c", "seed=20000", "sglang_deploy.launch.port_base=${seed}"])
    engines = json.loads(capsys.readouterr().out)["models"]["actor"]["groups"]["regular"]["engines"]
    assert rc == 0 and min(e["launch"][0]["port"] for e in engines) in range(20000, 20010)
    cfg = compose_config(["hf_checkpoint=/c", "seed=20000", "sglang_deploy.launch.port_base=${seed}"])
    assert prepare_from_config(cfg).settings.launch.port_base == 20000
    settings = deploy_settings_from_config(
        compose_config(
            ["sglang_deploy.router.policy=round_robin", "sglang_deploy.router.prefill_policy=${.policy}"]
        )
    )
    assert settings.router.prefill_policy == "round_robin"
    app_cfg = compose_config(
        ["+rollout.gpu_memory_utilization=0.7",
         "+sglang_deploy.server_defaults.mem_fraction_static=${rollout.gpu_memory_utilization}"],
        "ppo_trainer", config_dir=APP / "config", return_hydra_config=True,
    )  # fmt: skip
    assert dict(prepare_from_config(app_cfg).settings.server_defaults) == {"mem_fraction_static": 0.7}


def test_an_interpolation_to_a_key_that_is_not_there_names_both(capsys):
    # ${..policy} from router.prefill_policy is sglang_deploy.policy, which does not exist (${.policy} does)
    rc, _, err = plan_cli(capsys, "hf_checkpoint=/c", "sglang_deploy.router.prefill_policy=${..policy}")
    assert rc == 2
    assert "sglang_deploy.router.prefill_policy: Interpolation key 'policy' not found" in err


FOUND_BY_THE_FUZZER = {
    ("sglang.actor=${..policy}",): "sglang.actor: Interpolation key 'policy' not found",
    ("sglang=pd_actor_ref", "++sglang.ref.regular.overrides=${.policy}"): "sglang.ref.regular.overrides: "
    "Interpolation key 'policy' not found",
    (
        "+sglang=${oc.select:missing,3}",
    ): "Hydra could not compose these overrides (an internal check of Hydra failed: default_element.py:",
    (
        "sglang.actor.regular.overrides=${msp.trainer:hf_checkpoint,null}",
    ): "sglang.actor.regular.overrides: must map ServerArgs fields to values, got '/c'",
}


@pytest.mark.parametrize("overrides", sorted(FOUND_BY_THE_FUZZER))
def test_interpolations_that_do_not_resolve_where_the_group_is_read(capsys, overrides: tuple[str, ...]):
    rc, _, err = plan_cli(capsys, "hf_checkpoint=/c", *overrides)
    assert rc == 2 and "Traceback" not in err
    assert FOUND_BY_THE_FUZZER[overrides] in err


# ------------------------------------------------------------------------------- (d) one validation path
ONLY_AT_LAUNCH_BEFORE = {
    "+sglang.actor.regular.overrides.mem_fraction_statc=0.8": "sglang.actor.regular.overrides.mem_fraction_statc: "
    "is not a ServerArgs field of the installed SGLang; did you mean mem_fraction_static?",
    "sglang_deploy.router.policy=bogus": "sglang_deploy.router: policy: unknown policy 'bogus'",
    "sglang_deploy.launch.port_base=80": "sglang_deploy.launch.port_base: must be an integer in 1024..32766 (ports are handed out below the ephemeral range, 32768), got 80",
}


@pytest.mark.parametrize("override", sorted(ONLY_AT_LAUNCH_BEFORE))
def test_resolve_config_prepare_and_launch_make_the_same_checks(monkeypatch, override: str):
    monkeypatch.setattr(
        hydra_edge, "get_backend", lambda name: pytest.fail("the launch went past the checks")
    )
    cfg = compose_config(["hf_checkpoint=/c", override])
    messages = []
    for call in (resolve_config, prepare_from_config):
        with pytest.raises(DeploymentConfigError) as exc:
            call(cfg)
        messages.append(str(exc.value))
    with pytest.raises(DeploymentConfigError) as exc, launch_from_config(cfg):
        pass
    messages.append(str(exc.value))
    assert messages[0] == messages[1] == messages[2]
    assert ONLY_AT_LAUNCH_BEFORE[override] in " ".join(messages[0].split())


def test_the_apps_first_call_stops_it_on_those(app_dir: Path):
    proc = run_app(
        app_dir, "+actor_rollout_ref.rollout.engines.actor.decode.overrides.mem_fraction_statc=0.8"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "PLAN" not in proc.stdout
    assert "did you mean mem_fraction_static?" in proc.stderr


# ------------------------------------------------------------------------- (e) Ctrl-C during the imports
INTERRUPT_AT_IMPORT = textwrap.dedent(
    """
    import runpy, sys

    target, how = sys.argv[1], sys.argv[2]

    class Interrupt:
        def find_spec(self, name, path=None, target_module=None):
            if name == target:
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, Interrupt())
    sys.argv = ["miles-sglang", "plan", "hf_checkpoint=/c"]
    if how == "module":
        runpy.run_module("miles_sglang_plugin", run_name="__main__", alter_sys=True)
    else:  # what the console script does
        from miles_sglang_plugin.cli import main
        sys.exit(main())
    """
)


@pytest.mark.parametrize(
    ("module", "how"),
    [
        ("miles_sglang_plugin.cli", "module"),
        ("rich.console", "module"),
        ("hydra", "script"),
        ("miles_sglang_plugin.app.hydra_edge", "script"),
        ("miles_sglang_plugin.rendering.server_arg_fields", "script"),
    ],
)
def test_ctrl_c_while_the_command_loads_is_one_line_and_status_130(module: str, how: str):
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_IMPORT, module, how], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "interrupted\n", "")


# ---------------------------------------------------------------------------------- field docstrings
def schema_classes() -> list[type]:
    return [obj for obj in vars(schema).values() if dataclasses.is_dataclass(obj)] + [TrainerInputs]


@pytest.mark.parametrize("cls", schema_classes(), ids=lambda c: c.__name__)
def test_every_field_has_a_one_line_docstring(cls: type):
    docs = field_docs(cls)
    assert [name for name, doc in docs.items() if not doc] == []
    assert [name for name, doc in docs.items() if "\n" in doc or not doc.endswith(".")] == []


def test_a_subclass_of_the_root_schema_keeps_the_docs_and_adds_its_own():
    @dataclasses.dataclass
    class TrainConf(schema.MilesTrainerArgs):
        num_rollout: int = 1
        """Rollout steps to run."""

    docs = field_docs(TrainConf)
    assert docs["num_rollout"] == "Rollout steps to run."
    assert docs["seed"] == "Base of each engine's --random-seed (Miles: seed + the engine's rank)."


# ---------------------------------------------------------------------------------------------- noise
def test_never_shows_no_start_up_lines_and_auto_off_a_terminal_shows_plain_ones():
    from miles_sglang_plugin.backends.status_view import StatusView

    printed = {}
    for mode in ("never", "auto"):
        out = io.StringIO()
        view = StatusView(mode=mode, console=Console(file=out, force_terminal=False, width=120))
        view.track("actor.regular.0", "engine", "GPUs 0")
        view.update("actor.regular.0", "healthy")
        view.note("stand-in engines run side by side")
        view.finish()
        printed[mode] = out.getvalue().splitlines()
    assert printed["never"] == ["note: stand-in engines run side by side"]
    assert [line.split("] ", 1)[1] for line in printed["auto"][:1]] == ["engine actor.regular.0: healthy"]


class _Workers(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b'{"workers": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_the_launchers_own_requests_stay_out_of_the_apps_log(caplog):
    from miles_sglang_plugin.serving import quiet_http
    from tests.router_helpers import router_workers

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Workers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        quiet_http.install()  # as a deployment's start does
        with caplog.at_level(logging.INFO, logger="httpx"):
            assert router_workers(url) == []  # the package's router client, on its kept clients
            httpx.get(f"{url}/workers", timeout=5)  # the app's own
    finally:
        server.shutdown()
        server.server_close()
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert lines == [f'HTTP Request: GET {url}/workers "HTTP/1.1 200 OK"']


def test_the_request_filter_comes_with_a_start_not_with_an_import() -> None:
    """Importing what a Hydra app imports, the router client included, leaves the app's logging as it is; a
    deployment's start installs the filter (``quiet_http.install``), once however often it is called."""
    code = textwrap.dedent(
        """
        import logging
        import miles_sglang_plugin.app.hydra_edge
        import miles_sglang_plugin.serving.router_client
        from miles_sglang_plugin.serving import quiet_http
        print(logging.getLogger("httpx").filters)
        for _ in range(2):
            quiet_http.install()
        print([type(f).__name__ for f in logging.getLogger("httpx").filters])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.splitlines() == ["[]", "['OwnRequestsFilter']"]


def test_a_reader_that_goes_away_ends_plan_quietly_with_status_141():
    """``miles-sglang plan --json | head``: the command stops at the broken pipe, with no traceback and no
    "Exception ignored" from the interpreter's last flush (4,096 engines: far more than a pipe's buffer)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_sglang_plugin", "plan", "--json", "sglang=default", "hf_checkpoint=/c",
         "debug_rollout_only=true", "sglang.actor.regular.num_gpus=4096", "sglang.actor.num_gpus_per_engine=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100).startswith(b"{\n")
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert stderr == b""


def test_a_broken_pipe_of_a_launch_is_not_taken_for_a_closed_stdout(monkeypatch: pytest.MonkeyPatch):
    """Only a printing command's broken pipe is its reader going away: a launch's (a socket's, a child's) is an
    error, raised as it was."""
    from miles_sglang_plugin import cli

    def broken(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_cmd_launch", broken)
    with pytest.raises(BrokenPipeError):
        main(["launch", "sglang=pd_actor_ref", "hf_checkpoint=/c"])
