"""The public path of `atrctl.core.advantages`, where the module lives (the math core): code outside the package
keeps importing `atrctl.advantages`."""

from atrctl.core.advantages import *  # noqa: F403
