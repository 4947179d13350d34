"""What a Hydra app calls (:mod:`.hydra_edge`: ``resolve_config``, ``launch_from_config``) and the Hydra
callbacks the ``sglang`` group ships (:mod:`.callbacks`). It wires the stages together; the stages know
nothing of it."""
