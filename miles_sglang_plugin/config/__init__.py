"""Stage 1, composition and the Hydra edge: what the user and the trainer describe.

The ``sglang`` group's structured configs (:mod:`.schema`) and their ConfigStore registration (:mod:`.store`),
Hydra's compose API for the command line (:mod:`.compose`), the resolver's format-neutral inputs (the
deployment as written, :mod:`.deployment_spec`; the trainer's arguments under Miles' names,
:mod:`.trainer_inputs`), and reading a composed config into them (:mod:`.reading`). Hydra and OmegaConf stop
here: later stages see plain dataclasses.
"""
