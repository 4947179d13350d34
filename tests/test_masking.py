"""Masking (``masking.py``): exactly the secret values are replaced by ``***``, everything else is kept as it
was, so that a printed command or environment still says what was run."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.masking import mask_argv, mask_env
from miles_sglang_plugin.rendering.launch_specs import ProcessTemplate


def test_only_the_value_of_a_secret_flag_is_masked_not_the_program_or_the_words_after_it() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "k1", "stray", "--port", "1"]
    assert mask_argv(argv) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--api-key",
        "***",
        "stray",
        "--port",
        "1",
    ]


def test_the_token_after_a_secret_flag_is_masked_whatever_its_shape_and_only_that_one() -> None:
    # By position: a key may look like a flag ("--port", "--host=h"); the token after it is a plain word again.
    assert mask_argv(["--api-key", "--port", "1"]) == ["--api-key", "***", "1"]
    assert mask_argv(["--admin-api-key", "--host=h", "k"]) == ["--admin-api-key", "***", "k"]
    assert mask_argv(["--api-key", "--api-key", "k"]) == ["--api-key", "***", "k"]
    assert mask_argv(["--API_KEY=--x", "--port", "1"]) == ["--API_KEY=***", "--port", "1"]
    # Another flag whose name merely holds the word is not one: only the leading dashes are dropped from a name.
    assert mask_argv(["--Xapi-key", "v"]) == ["--Xapi-key", "v"]
    # A secret flag at the end has no value to mask.
    assert mask_argv(["--port", "1", "--api-key"]) == ["--port", "1", "--api-key"]


def test_mask_env_masks_the_variables_whose_names_hold_a_secret_word_in_any_case() -> None:
    env = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_DEBUG": "INFO",
        "SGLANG_API_KEY": "s1",
        "hf_token": "s2",
        "Db_Password": "s3",
        "AWS_SECRET_ACCESS_KEY": "s4",
        "GOOGLE_APPLICATION_CREDENTIALS": "s5",
    }
    assert mask_env(env) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_DEBUG": "INFO",
        "SGLANG_API_KEY": "***",
        "hf_token": "***",
        "Db_Password": "***",
        "AWS_SECRET_ACCESS_KEY": "***",
        "GOOGLE_APPLICATION_CREDENTIALS": "***",
    }


def test_a_sweeps_overrides_keep_their_parameters_and_lose_their_secrets() -> None:
    from miles_sglang_plugin.masking import mask_overrides

    assert mask_overrides(
        [
            "sglang.actor.decode.num_gpus_per_engine=4",
            "sglang_deploy.api_key=sk-1",
            "+sglang_deploy.api_key='--x'",
            "++sglang_deploy.admin_api_key=k",
            "sglang_deploy.env.HF_TOKEN=hf_1",
            "+sglang_deploy.env.NCCL_DEBUG=INFO",
            "sglang_deploy.env={HF_TOKEN:hf_2}",
            "sglang_deploy={api_key:sk-2}",
            "sglang_deploy={launch:{backend:local}}",
            "~sglang_deploy.api_key",
            "sglang@actor_rollout_ref.rollout.engines=pd",
            "sglang_deploy.api-key=sk-3",
            "+sglang.actor.regular.overrides.API-KEY=sk-4",
            "+sglang_deploy.server_defaults.admin-api-key=sk-5",
            "sglang_deploy={env:{HF_TOKEN:hf_3}}",
            "sglang_deploy={launch:{backend:local},Admin-Api-Key:k}",
            "sglang_deploy.environment_note=x",
        ]
    ) == [
        "sglang.actor.decode.num_gpus_per_engine=4",
        "sglang_deploy.api_key=***",
        "+sglang_deploy.api_key=***",
        "++sglang_deploy.admin_api_key=***",
        "sglang_deploy.env.HF_TOKEN=***",
        "+sglang_deploy.env.NCCL_DEBUG=INFO",  # on the allow-list: a sweep over it stays readable
        "sglang_deploy.env=***",
        "sglang_deploy=***",
        "sglang_deploy={launch:{backend:local}}",
        "~sglang_deploy.api_key",
        "sglang@actor_rollout_ref.rollout.engines=pd",
        "sglang_deploy.api-key=***",
        "+sglang.actor.regular.overrides.API-KEY=***",
        "+sglang_deploy.server_defaults.admin-api-key=***",
        "sglang_deploy=***",
        "sglang_deploy=***",
        "sglang_deploy.environment_note=x",
    ]


def test_a_secrets_value_must_be_printable_ascii_and_the_message_never_shows_it() -> None:
    from miles_sglang_plugin.masking import secret_value_problem

    assert secret_value_problem(None) is None and secret_value_problem("sk-abc_DEF.123~") is None
    assert secret_value_problem("with inner space") is None  # a header value may hold one
    for bad in ("a\nb", "a\rb", "a\0b", "a\x1bb", "caf\u00e9"):
        problem = secret_value_problem(bad)
        assert problem is not None and "printable ASCII" in problem and bad not in problem
    assert "must be a string, got int" in (secret_value_problem(5) or "")


def test_a_secret_override_is_masked_however_its_key_and_value_are_written() -> None:
    from miles_sglang_plugin.masking import mask_override

    cases = {
        "sglang_deploy.api_key=a=b": "sglang_deploy.api_key=***",  # the value holds '=': masked whole
        "+env.HF_TOKEN=hf_1": "+env.HF_TOKEN=***",  # the '+' is not part of the first key
        "sglang_deploy.env= {HF_TOKEN: hf_2}": "sglang_deploy.env=***",  # a mapping after a blank
        "sglang_deploy.launch.env={FOO:bar}": "sglang_deploy.launch.env=***",  # any key ending in env
        "sglang_deploy.launch.command=[python,--api-key,sk-3]": "sglang_deploy.launch.command=***",
        "sglang_deploy.launch.command=[python,-m,sglang.launch_server]": (
            "sglang_deploy.launch.command=[python,-m,sglang.launch_server]"
        ),
        "sglang_deploy.launch.host=envoy.local": "sglang_deploy.launch.host=envoy.local",  # a word, no env
        "sglang_deploy.api_key": "sglang_deploy.api_key",  # no value: nothing to mask
        "Xenv.HF_TOKEN=v": "Xenv.HF_TOKEN=v",  # a key named Xenv is no env mapping
        "sglang_deploy@x.api_key=simulated": "sglang_deploy@x.api_key=simulated",  # a group choice's package
    }
    assert {override: mask_override(override) for override in cases} == cases


def test_the_secret_values_of_overrides_are_found_whole_and_inside_lists_and_mappings() -> None:
    from miles_sglang_plugin.masking import override_secret_values

    assert override_secret_values(
        [
            "sglang_deploy.api_key='sk-quoted 1'",
            'sglang_deploy.env={HF_TOKEN: hf_x, OTHER: "two words"}',
            "sglang_deploy.launch.api_keys_list=[k1, 'k 2']",  # not a secret field: nothing from it
            "+sglang_deploy.admin_api_key=[adm1,adm2]",
            "sglang.actor.regular.num_gpus=8",
            "sglang_deploy.api_key=x",  # one character: no secret worth masking in text
            "+sglang_deploy.env.TOK=ab",  # two: one
            "sglang_deploy.api_key=Xk=1X",  # '=' in the value, and no quotes to take off
        ]
    ) == (
        '{HF_TOKEN: hf_x, OTHER: "two words"}',
        "'sk-quoted 1'",
        "[adm1,adm2]",
        "sk-quoted 1",
        "two words",
        "Xk=1X",
        "adm1",
        "adm2",
        "hf_x",
        "ab",
    )


def test_a_processes_secrets_are_its_secret_flags_values_and_its_long_unlisted_env_values() -> None:
    from miles_sglang_plugin.masking import secret_values

    argv = ["python", "--api-key", "sk-a", "--admin-api-key=adm=b", "--port", "1", "--api-key"]
    env = {
        "HF_TOKEN": "hf_longer",
        "SHORT": "12345",
        "SIX": "123456",
        "NCCL_DEBUG": "INFO_LONG",
        "MINE": "shown-v",
    }
    assert secret_values(argv, env, shown={"MINE"}) == ("hf_longer", "123456", "adm=b", "sk-a")
    assert secret_values(["x", "--api-key="], None) == ()  # an empty value is no secret


def test_mask_text_masks_whole_occurrences_longest_first() -> None:
    from miles_sglang_plugin.masking import mask_text

    text = "key=sk-1 again sk-1, task-12 sk-12x; 'sk-1-long' ab tab"
    assert (
        mask_text(text, ["sk-1", "sk-1-long", "ab", ""]) == "key=*** again ***, task-12 sk-12x; '***' *** tab"
    )


def test_what_is_wrong_with_a_secret_is_said_exactly() -> None:
    from miles_sglang_plugin.masking import secret_value_problem

    blanks = "must be a non-empty string without surrounding blanks (its value is not shown)"
    printable = (
        "must be printable ASCII: it holds a control character (a newline, tab or NUL) or a non-ASCII one, "
        "which would break the HTTP header it travels in (its value is not shown)"
    )
    assert [secret_value_problem(v) for v in ("", " k", "k ", "k\n1", "k\x7f", "~ !", None, 1.5)] == [
        blanks,
        blanks,
        blanks,
        printable,
        printable,
        None,
        None,
        "must be a string, got float (its value is not shown)",
    ]


# ---------------------------------------------------------------- command lines masked from their template
_VALUE = st.one_of(
    st.booleans(), st.none(), st.integers(-3, 3), st.sampled_from(["sk-1", "-x", "a b", "--api-key", ""]),
    st.lists(st.sampled_from(["sk", "-y", "z"]), max_size=2),
)  # fmt: skip
_KEY = st.sampled_from(["api_key", "admin_api_key", "API-KEY", "model_path", "tp_size", "port", "host"])
_PREFIX = st.lists(
    st.sampled_from(["python", "-m", "sglang", "--admin-api-key", "--api-key=s", "k"]), max_size=4
)


@settings(max_examples=300, deadline=None)
@given(
    prefix=_PREFIX,
    values=st.dictionaries(_KEY, _VALUE, max_size=6),
    own=st.sets(st.sampled_from(["port", "host"])),
    own_values=st.tuples(st.integers(-2, 20000), st.sampled_from(["127.0.0.1", "-h", "<node 1 address>"])),
)
def test_a_command_line_masked_from_its_template_is_mask_argv_of_it(
    prefix: list[str], values: dict, own: set[str], own_values: tuple
) -> None:
    """The masked command line of every engine process is made from its group's chunks masked once; where a
    chunk leaves a bare secret flag (its value the next chunk's first token) the whole line is masked instead:
    always what ``mask_argv`` makes of the whole command line."""
    own_keys = tuple(k for k in values if k in own)
    template = ProcessTemplate.of(tuple(prefix), values, own_keys, {}, {}, None)
    given_own = tuple(own_values[0] if k == "port" else own_values[1] for k in own_keys)
    assert template.masked_argv(given_own) == mask_argv(template.argv(given_own))
