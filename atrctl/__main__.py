"""`python -m atrctl` (also what torchrun launches)."""

import sys

from atrctl.cli import main

sys.exit(main())
