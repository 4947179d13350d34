"""A Hydra callback that stops any deployment a job left running, at the end of each job (multirun included).

Select it with ``hydra/callbacks=sglang_cleanup`` (or in the app's defaults list). ``launch_from_config`` used
as a ``with`` block already stops its deployment; this is the safety net for code that does not.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback


class SGLangCleanupCallback(Callback):
    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from miles_sglang_plugin.serving.deployment import stop_all_active

        stop_all_active()
