"""The optimizer step over parts of a model, in a room of its own: which optimizers may step a block at a time
(:mod:`.optimizers`), an optimizer restricted to some parameters (:mod:`.param_groups`), and the modes a step runs
in (:mod:`.step_modes`): during backward (:mod:`.overlap`), speculatively with the previous state kept
(:mod:`.speculation`), or pipelined into the next forward (:mod:`.pipelined`).

The kinds of home (:mod:`lightning_superpipe.memory`) build on it, and the engine above them runs it; it sees both
through the Protocols beside the code that needs them.
"""
