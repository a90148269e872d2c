"""The error of :func:`~lightning_superpipe.generate`, in a module of its own so that the API and the policy both
raise it without importing each other."""


class GenerationError(ValueError):
    """A bad argument or a model or budget :func:`generate` cannot serve; the message says what to change."""


__all__ = ["GenerationError"]
