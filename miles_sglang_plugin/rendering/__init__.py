"""Stage 3, rendering: the exact argv and environment of every engine process and router, as pure data
(:mod:`.launch_specs`, :mod:`.router_specs`), the ports they use (:mod:`.ports`), SGLang's own parser and field
names to check them against (:mod:`.sglang_server_args`, :mod:`.server_arg_fields`), and both together with the
plan (:mod:`.prepared`)."""
