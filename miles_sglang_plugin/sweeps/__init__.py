"""Sweeps: the per-job rollout benchmark (``sglang_bench``), the sweep report (``hydra/callbacks=
sglang_sweep_report``, ``miles-sglang sweep-report``) and the GPU-aware parallel launcher
(``hydra/launcher=sglang_packed``). Above ``app`` in the layers; Hydra's plugin scan imports only
:mod:`.conf` (plain dataclasses)."""
