"""Experiments built from runs: evaluating a run or model, arms, comparisons and sweeps with their reports."""
