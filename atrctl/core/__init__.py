"""The math core: trust regions (divergence, bands), policy losses, advantages, pass@k and seed derivation.

Pure functions of numbers and tensors: no files, no recipes, nothing else of atrctl imported
(`tests/test_layers.py` checks), so each can be read, tested and reused on its own.
"""
