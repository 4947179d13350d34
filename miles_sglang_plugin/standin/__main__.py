"""``python -m miles_sglang_plugin.standin <sglang.launch_server argv>``: run the stand-in engine."""

from miles_sglang_plugin.standin.engine import main

if __name__ == "__main__":
    raise SystemExit(main())
