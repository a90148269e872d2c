"""The emulated asynchronous device: the CUDA copy protocol on the CPU, with deferred copies and a happens-before
checker, so that ordering bugs show on machines without a GPU (:mod:`.link`)."""

from lightning_superpipe.emulation.link import EmulatedLink, OrderingViolation

__all__ = ["EmulatedLink", "OrderingViolation"]
