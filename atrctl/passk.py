"""The public path of `atrctl.core.passk`, where the module lives (the math core): code outside the package
keeps importing `atrctl.passk`."""

from atrctl.core.passk import *  # noqa: F403
