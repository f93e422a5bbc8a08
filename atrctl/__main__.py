"""`python -m atrctl` (also what torchrun launches)."""

import os
import sys

from atrctl.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under torchrun, leave without running C++ static destructors: gloo's teardown at interpreter exit
    # intermittently aborts a rank ("terminate called without an active exception") after all its work,
    # including the process-group shutdown, is done. Output is flushed first; the exit code is kept.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
