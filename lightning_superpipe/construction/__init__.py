"""Building a model larger than host memory: ``configure_model``'s init calls recorded and run a block at a time, and
safetensors read into (or written from) a model without a whole copy of it (:mod:`.deferred_init`)."""

from lightning_superpipe.construction.deferred_init import DeferredInit, load_safetensors, save_safetensors

__all__ = ["DeferredInit", "load_safetensors", "save_safetensors"]
