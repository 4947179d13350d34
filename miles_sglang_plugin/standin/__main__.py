"""``python -m miles_sglang_plugin.standin <sglang.launch_server argv>``: run the stand-in engine.

Once :func:`~miles_sglang_plugin.standin.engine.main` has returned, everything is stopped and said: the
process ends at once with its code (``os._exit`` after flushing), without the interpreter's teardown of every
module and object, which took 0.1-0.3 s of CPU per stand-in (a deployment's teardown waited for it)."""

import logging
import os
import sys

from miles_sglang_plugin.standin.engine import main

if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
