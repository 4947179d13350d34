"""Miles and slime formats: their ``--sglang-config`` YAML (:mod:`.sglang_config`), their ``argparse.Namespace``
(:mod:`.argparse_bridge`), and the ``import`` / ``export`` commands between those and the ``sglang`` group
(:mod:`.commands`)."""
