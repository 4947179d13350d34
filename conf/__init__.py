"""Config files of miles_sglang_plugin (the ``sglang`` presets), shipped as package data."""
