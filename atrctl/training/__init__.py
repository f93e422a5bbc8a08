"""A training run, one job per module: the loop and its step, the checks before any work, micro-batches,
checkpoints and the run directory, sharding, the bad-step rollback, the warmed-up base and the trackers."""
