"""One run of the strategy: its knobs (:mod:`.options`), starting to stream (:mod:`.setup`), the calls the strategy's
hooks make into a streaming run (:mod:`.session`), and what checkpoints add to Lightning's (:mod:`.checkpoints`)."""

from lightning_superpipe.run.options import KnobError, SuperpipeOptions
from lightning_superpipe.run.session import StreamingSession

__all__ = ["KnobError", "StreamingSession", "SuperpipeOptions"]
