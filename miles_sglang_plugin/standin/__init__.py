"""A stand-in for ``python -m sglang.launch_server``: NOT a real SGLang engine.

SGLang engines need GPUs; this package provides a small aiohttp server that accepts (and checks) the same
argv and answers the HTTP endpoints that launchers, routers and RL trainers call, with deterministic fake
generations. Run it as ``python -m miles_sglang_plugin.standin <launch_server argv>``; see
``miles_sglang_plugin.standin.engine`` for the endpoints and the fault-injection environment variables.
"""
