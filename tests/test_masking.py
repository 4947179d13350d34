"""Masking (``masking.py``): exactly the secret values are replaced by ``***``, everything else is kept as it
was, so that a printed command or environment still says what was run."""

from __future__ import annotations

from miles_sglang_plugin.masking import mask_argv, mask_env


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
