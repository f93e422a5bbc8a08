"""The public path of `atrctl.core.losses`, where the module lives (the math core): code outside the package
keeps importing `atrctl.losses`."""

from atrctl.core.losses import *  # noqa: F403
