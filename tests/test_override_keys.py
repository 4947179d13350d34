"""``miles-sglang fields --overrides``: the keys a group's ``overrides`` accept (SGLang's ServerArgs fields less
those the plan sets), with SGLang's own help text where SGLang is installed, and a link to SGLang's docs."""

from __future__ import annotations

import re

import pytest

from miles_sglang_plugin import compose_config, resolve_config
from miles_sglang_plugin.cli import main
from miles_sglang_plugin.rendering import sglang_server_args as sglang_parser

HAVE_SGLANG = sglang_parser.server_args_fields() is not None


def listed(out: str) -> list[str]:
    """The keys of the listing (each at the start of its line, its type after two blanks)."""
    return re.findall(r"^([a-z]\w*)  ", out, flags=re.M)


def test_the_keys_holding_a_text_with_sglangs_help(capsys):
    assert main(["fields", "--overrides", "mem_fraction"]) == 0
    out = capsys.readouterr().out
    assert listed(out) == ["mem_fraction_static"]
    assert "mem_fraction_static  float" in out
    assert "https://docs.sglang.ai/advanced_features/server_arguments.html" in out
    text = " ".join(out.split())
    if HAVE_SGLANG:  # SGLang 0.5.23's own words for --mem-fraction-static
        assert (
            "The fraction of the memory used for static allocation (model weights and KV cache memory pool)"
            in text
        )
    else:
        assert "SGLang's help text: SGLang is not installed here" in text


def test_the_plans_own_keys_are_named_as_refused_not_listed(capsys):
    assert main(["fields", "--overrides"]) == 0
    out = capsys.readouterr().out
    keys = listed(out)
    for owned in ("host", "port", "nccl_port", "api_key", "node_rank"):
        assert owned not in keys
    assert "Set by the plan, refused in both: admin_api_key, api_key, base_gpu_id" in out
    assert "tp_size" in out.split("Refused in server_defaults only", 1)[1].splitlines()[0]
    assert "chunked_prefill_size" in keys and "enable_memory_saver" in keys  # a group may set them
    assert not any(key.startswith("_") for key in keys)


@pytest.mark.parametrize("key", ["chunked_prefill_size", "mem_fraction_static"])
def test_a_listed_key_is_accepted_in_a_groups_overrides(capsys, key: str):
    assert main(["fields", "--overrides", key]) == 0
    assert key in listed(capsys.readouterr().out)
    value = {"chunked_prefill_size": 4096, "mem_fraction_static": 0.8}[key]
    plan = resolve_config(
        compose_config(["hf_checkpoint=/c", f"+sglang.actor.regular.overrides.{key}={value}"])
    )
    assert plan.model("actor").group("regular").overrides[key] == value


def test_no_key_holds_the_text(capsys):
    assert main(["fields", "--overrides", "memfrac"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: no override key holds 'memfrac'; miles-sglang fields --overrides lists them all" in err
