"""The 4-bit frozen form of a block's weights, in one place: frozen matrices that live in their block's home as the
bytes of their codes and scales, cross the link as those bytes, and are rebuilt on the device for each use.

* :mod:`.packed`: a packed weight in a home (its slice, its format, its state-dict entries), whatever made it;
* :mod:`.bnb4bit`: bitsandbytes' 4-bit weights (QLoRA's base) as packed weights;
* :mod:`.frozen4bit`: plain frozen matrices the strategy quantizes itself (``quantize_frozen``);
* :mod:`.frozen_quantization`: ``quantize_frozen`` for one run (refusals, state-dict hooks, the values given back);
* :mod:`.quantized_layers`: which quantized layers stream, and one clear error for the others;
* :mod:`.packed_state`: state dicts that hold copies of packed weights, not views into their homes.

Both kinds of home hold them (the disk tier in read-only files of its own: :mod:`lightning_superpipe.memory.disk.
frozen`).
"""
