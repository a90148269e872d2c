"""Stepping an optimizer over parts of a model: which optimizers may step a block at a time, a stand-in that steps
some parameters with the hyperparameters in force now, and an optimizer's groups restricted to some parameters.

The kinds of home (:mod:`lightning_superpipe.memory`) and the engine's step modes build on these.
"""
