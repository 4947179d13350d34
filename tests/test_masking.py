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
