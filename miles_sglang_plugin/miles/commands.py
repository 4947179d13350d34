"""``miles-sglang import`` and ``miles-sglang export``: Miles/slime ``--sglang-config`` files ↔ ``sglang`` presets.

miles-sglang import FILE [--name NAME] [--output-dir DIR | --print] [--force]
    A Miles/slime file (or ``base64:...``) → the preset ``DIR/NAME.yaml`` (default ``conf/sglang/<file stem>.yaml``
    under the current directory), used with the Hydra override ``sglang=NAME``.
miles-sglang export [--output FILE] [HYDRA OVERRIDES...]
    The composed deployment → the file for Miles' own ``--sglang-config`` (stdout or FILE); the matching Miles
    arguments go to stderr and into a ``# miles args:`` comment at the top of the file.

User errors raise :class:`~miles_sglang_plugin.errors.DeploymentConfigError` /
:class:`~miles_sglang_plugin.config.compose.CompositionError`, or print one line and return status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from miles_sglang_plugin.config.deployment_spec import NAME_RE, DeploymentSpec
from miles_sglang_plugin.printable import escape_controls, shell_join, shell_quote

# The Miles file format (and its YAML reader) loads when a command runs, not when ``miles-sglang`` builds its
# parser: every other command (``plan``) starts without it.

EXIT_USER_ERROR = 2
#: A preset name usable as ``sglang=<name>`` and as a file name.
PRESET_NAME_RE = NAME_RE
#: Characters a Hydra override value may hold without quotes (anything else is quoted).
_HYDRA_PLAIN_RE = re.compile(r"^[A-Za-z0-9_./\-]+$")


def register(subparsers: Any) -> None:
    """Add ``import`` and ``export`` to the ``miles-sglang`` sub-command parsers."""
    p_imp = subparsers.add_parser(
        "import",
        help="convert a Miles/slime --sglang-config YAML file into a preset of the sglang config group",
        description="Read a Miles/slime --sglang-config file (or Miles' inline base64:<...> form), check it, and "
        "write it as a preset of the `sglang` Hydra config group, used with `sglang=NAME`. The default "
        "place, conf/sglang/ under the current directory, is where a Hydra app with config_path='conf' "
        "finds it.",
    )
    p_imp.add_argument("file", metavar="FILE", help="the YAML file, or base64:<base64 of the YAML>")
    p_imp.add_argument("--name", help="preset name (default: the file's stem)")
    where = p_imp.add_mutually_exclusive_group()
    where.add_argument(
        "--output-dir",
        metavar="DIR",
        help="where to write NAME.yaml: into DIR when DIR is a folder named sglang (the group's folder), else "
        "into DIR/sglang (DIR is then a config directory Hydra can search); default: conf/sglang under the "
        "current directory",
    )
    where.add_argument(
        "--print", dest="print_only", action="store_true", help="print the preset, write nothing"
    )
    p_imp.add_argument("--force", action="store_true", help="overwrite an existing preset file")
    p_imp.set_defaults(func=cmd_import)

    p_exp = subparsers.add_parser(
        "export",
        help="write the composed deployment as a Miles --sglang-config file, with the matching Miles arguments",
        description="Compose and resolve the deployment (like `plan`), then write the YAML file that Miles' own "
        "--sglang-config accepts and that resolves to the same deployment; the Miles arguments that go "
        "with it are printed to stderr and written as a `# miles args:` comment at the top of the file.",
    )
    p_exp.add_argument("--output", "-o", metavar="FILE", help="write the file here (default: stdout)")
    p_exp.add_argument("overrides", nargs="*", help="Hydra overrides, as for `plan`")
    p_exp.set_defaults(func=cmd_export)


# ====================================================================================================== import
def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def builtin_preset_names() -> frozenset[str]:
    """Names of the presets shipped with the package (``conf/sglang/*.yaml``)."""
    from miles_sglang_plugin.config.store import config_search_path

    location = config_search_path()
    names: set[str] = set()
    if location.startswith("pkg://"):
        from importlib import resources

        try:
            folder = resources.files(location[len("pkg://") :]).joinpath("sglang")
            names = {e.name[: -len(".yaml")] for e in folder.iterdir() if e.name.endswith(".yaml")}
        except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
            names = set()
    else:
        folder_path = Path(location[len("file://") :]) / "sglang"
        if folder_path.is_dir():
            names = {f.stem for f in folder_path.glob("*.yaml")}
    return frozenset(names)


def hydra_searchpath_override(directory: Path) -> str:
    """``hydra.searchpath=[file://<directory>]``, quoted for Hydra's override grammar where needed."""
    url = f"file://{directory}"
    item = (
        url
        if _HYDRA_PLAIN_RE.match(str(directory))
        else "'" + url.replace("\\", "\\\\").replace("'", "\\'") + "'"
    )
    return f"hydra.searchpath=[{item}]"


def _summary(spec: DeploymentSpec) -> tuple[str, int]:
    parts = []
    total = 0
    for model in spec.models:
        groups = ", ".join(f"{group.name} {group.num_gpus}" for group in model.groups)
        parts.append(f"{model.name} [{groups}]")
        total += sum(group.num_gpus for group in model.groups)
    return "; ".join(parts), total


def _loaded_for_this_sglang(source: str) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """The file's deployment without the override keys the installed SGLang lacks (as Miles drops them: an
    unmodified Miles file must give a preset that plans), and one note per key left out."""
    from miles_sglang_plugin.miles.sglang_config import load_miles_config
    from miles_sglang_plugin.planning.resolution import without_unknown_override_keys
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields

    known = known_server_arg_fields()
    spec, dropped = without_unknown_override_keys(load_miles_config(source), known.fields)
    return spec, tuple(f"{note} (checked against {known.source})" for note in dropped)


def _preset_name(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the preset's name, None), or (None, why the name cannot be used)."""
    from miles_sglang_plugin.miles.sglang_config import BASE64_PREFIX

    source: str = args.file
    name = args.name
    if name is None:
        if source.startswith(BASE64_PREFIX):
            return None, "an inline base64: config has no file name; give the preset a name with --name NAME"
        name = Path(source).stem
    if not PRESET_NAME_RE.match(name):
        suggestion = re.sub(r"[^A-Za-z0-9_\-]", "_", name)
        if not re.match(r"^[A-Za-z_]", suggestion):
            suggestion = f"_{suggestion}"
        return None, (
            f"{name!r} cannot name a preset (used as sglang={name}): it must start with a letter or '_' and hold "
            f"only letters, digits, '_' or '-'; choose one with --name, e.g. --name {suggestion}"
        )
    if name in builtin_preset_names():
        return None, (
            f"{name!r} is the name of a preset shipped with miles_sglang_plugin; which of the two sglang={name} "
            f"picks would depend on the search path order. Choose another with --name, e.g. --name {name}_imported"
        )
    return name, None


def _import_report(spec: DeploymentSpec, name: str, target: Path, notes: tuple[str, ...]) -> str:
    summary, total = _summary(spec)
    out_dir = target.parent
    conf_dir = out_dir.resolve().parent
    searchpath = hydra_searchpath_override(conf_dir)
    lines = [
        f"Wrote {target} (models: {summary}; {total} GPUs in all).",
        f"Use it with the Hydra override sglang={name}:",
        f"  - in a Hydra app whose config directory (config_path) is {conf_dir}: python <your app> sglang={name}",
        f"  - from anywhere else, add that directory to Hydra's search path: {shell_quote(searchpath)}, e.g.",
        f"      miles-sglang plan sglang={name} {shell_quote(searchpath)} rollout_num_gpus=... hf_checkpoint=...",
        f"Miles ran this file with --rollout-num-gpus {total} (minus --eval-num-gpus when a model named 'eval' is "
        "the eval fleet).",
    ]
    lines += [f"note: {note}" for note in notes]
    return "\n".join(lines)


def cmd_import(args: argparse.Namespace) -> int:
    name, error = _preset_name(args)
    if name is None:
        return _fail(error or "no preset name")
    from miles_sglang_plugin.miles.sglang_config import spec_to_preset

    spec, dropped = _loaded_for_this_sglang(args.file)
    text = spec_to_preset(spec, notes=dropped)
    if args.print_only:
        sys.stdout.write(text)
        for note in dropped:
            print(f"note: {escape_controls(note, keep_newlines=True)}", file=sys.stderr)
        return 0

    out_dir = _group_folder(Path(args.output_dir)) if args.output_dir else Path.cwd() / "conf" / "sglang"
    target = out_dir / f"{name}.yaml"
    if target.exists() and not args.force:
        return _fail(f"{target} already exists; pass --force to overwrite it")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror or exc}")
    print(_import_report(spec, name, target, dropped))
    return 0


def _group_folder(directory: Path) -> Path:
    """Where a preset goes for ``--output-dir``: Hydra finds options of the ``sglang`` group only in a folder
    named ``sglang`` on its search path, so a directory of another name is taken as the config directory."""
    return directory if directory.name == "sglang" else directory / "sglang"


# ====================================================================================================== export
def server_default_args(server_defaults: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``sglang_deploy.server_defaults`` as Miles' ``--sglang-*`` flags, and notes for values no flag carries."""
    args: list[str] = []
    notes: list[str] = []
    for field, value in server_defaults.items():
        flag = "--sglang-" + str(field).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            notes.append(
                f"sglang_deploy.server_defaults.{field}={value!r} has no Miles flag form ({flag} can only switch "
                "it on); it is SGLang's default unless you changed it elsewhere"
            )
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            notes.append(
                f"sglang_deploy.server_defaults.{field} is a mapping; pass it to Miles as {flag} yourself "
                "(in the form SGLang's parser expects)"
            )
        else:
            args += [flag, str(value)]
    return args, notes


def miles_lora_args(lora: Any) -> list[str]:
    """Miles' LoRA arguments that give the engines ``sglang_deploy.lora``'s LoRA settings (``--lora-rank`` is
    ``max_lora_rank``; a single adapter path becomes ``--lora-adapter-path``)."""
    args = ["--lora-rank", str(lora.max_lora_rank)]
    if lora.target_modules:
        args += ["--target-modules", ",".join(lora.target_modules)]
    if lora.multi_lora_n_adapters:
        args += ["--multi-lora-n-adapters", str(lora.multi_lora_n_adapters)]
    elif len(lora.paths) == 1:
        args += ["--lora-adapter-path", next(iter(lora.paths.values()))]
    if lora.base_cpu_backup:
        args.append("--lora-base-cpu-backup")
    return args


def deploy_notes(deploy: Any) -> list[str]:
    """Deployment-wide settings the Miles file cannot carry: said, not silently dropped."""
    notes = []
    router = getattr(deploy, "router", None)
    if router is not None and getattr(router, "policy", "cache_aware") != "cache_aware":
        notes.append(
            f"sglang_deploy.router.policy={router.policy!r} is not part of the file; pass it to Miles as "
            f"--sglang-router-policy {router.policy}"
        )
    lora = getattr(deploy, "lora", None)
    if lora is not None and (lora.enabled or lora.multi_lora_n_adapters):
        notes.append(
            "sglang_deploy.lora is not part of the file; Miles derives the engines' LoRA arguments from its "
            f"training arguments: {shell_join(miles_lora_args(lora))}"
        )
    if getattr(deploy, "env", None):
        notes.append("sglang_deploy.env is not part of the file; set those variables in Miles' environment")
    if getattr(deploy, "api_key", None):
        notes.append(
            "an API key is set (sglang_deploy.api_key or SGLANG_API_KEY); a secret is never written to the file "
            "or printed: give it to Miles' engines and router yourself"
        )
    return notes


def cmd_export(args: argparse.Namespace) -> int:
    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.config.reading import spec_from_config
    from miles_sglang_plugin.miles.sglang_config import miles_trainer_args, spec_to_miles_yaml

    cfg = compose_config(args.overrides)
    prepared = prepare_from_config(cfg)  # every check `plan` makes: never export what Miles would run wrongly
    plan = prepared.plan
    spec = spec_from_config(cfg)
    text = spec_to_miles_yaml(spec, plan)

    miles_args = miles_trainer_args(plan, sglang_config=args.output or "FILE")
    deploy = prepared.settings
    extra, notes = server_default_args(dict(deploy.server_defaults))
    notes += deploy_notes(deploy)
    miles_args += extra
    line = shell_join(miles_args)  # one line: a control character is $'...' quoted
    header = f"# miles args: {line}\n"
    content = header + text

    if args.output:
        try:
            Path(args.output).write_text(content, encoding="utf-8")
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc.strerror or exc}")
        print(f"Wrote {args.output}. Run Miles with:", file=sys.stderr)
    else:
        sys.stdout.write(content)
        print("Miles arguments for this file (FILE: where you save it):", file=sys.stderr)
    print(f"  {line}", file=sys.stderr)
    for note in notes:
        print(f"note: {escape_controls(note, keep_newlines=True)}", file=sys.stderr)
    return 0
