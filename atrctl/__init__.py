"""atrctl: GRPO and ATR-GRPO experiments on small causal LMs."""

__version__ = "0.1.0"
