"""Producing and scoring completions: the backend protocol and its registry, the Hugging Face sampler, prompts,
rewards, and the pass@k evaluation of a model built on them."""
