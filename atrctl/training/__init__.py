"""The parts of a training run, one job each, that `atrctl.train` (the run's lifecycle and its step) puts
together: the data order and learning-rate schedule, the checks made before any work, the update's
micro-batches, and how a step's metrics are timed and reduced over micro-batches and ranks."""
