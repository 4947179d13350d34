"""Environment variables a backend sets for the engine processes it starts (a shared leaf, no imports): the
stand-in engine reports them, so that tests can see where each engine ran."""

from __future__ import annotations

#: The node an engine process runs on, as its backend names it (the ray backend: the Ray node id).
NODE_ID_ENV = "MSP_ENGINE_NODE_ID"
