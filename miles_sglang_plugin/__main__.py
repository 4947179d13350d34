"""``python -m miles_sglang_plugin``: the ``miles-sglang`` command. A Ctrl-C while it loads ends it with one
line and status 130 (:func:`miles_sglang_plugin.cli.main` does the same for everything after this import)."""

import sys

try:
    from miles_sglang_plugin.cli import main
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None

raise SystemExit(main())
