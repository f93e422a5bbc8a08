"""The public path of `atrctl.core.divergence`, where the module lives (the math core): code outside the package
keeps importing `atrctl.divergence`."""

from atrctl.core.divergence import *  # noqa: F403
