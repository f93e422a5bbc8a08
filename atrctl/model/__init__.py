"""Models and their passes: loading, numerics and memory budgets, LoRA adapters, the token batch every pass
reads, and the decoder and log-probability passes that sampling and training share."""
