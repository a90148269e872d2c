"""A local model folder like one downloaded from the Hugging Face Hub, built offline, for trying ``pretrained_path``.

Nothing is downloaded: the model has random weights from a small config, and the tokenizer is a byte-pair encoding
trained in about a second on Python's documentation (``pydoc_data.topics``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_superpipe.recipes.text_data import embedded_documents


def train_bpe_tokenizer(vocab_size: int = 384) -> Any:
    """A ``transformers`` fast tokenizer trained on the embedded corpus, with ``<s>``, ``</s>`` and ``<pad>``.

    Args:
        vocab_size: Size of the vocabulary, special tokens included.

    Returns:
        A ``PreTrainedTokenizerFast`` that adds ``<s>`` at the start of each text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(embedded_documents(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_tiny_pretrained(
    folder: str | Path, model_type: str = "llama", with_tokenizer: bool = True, **config: Any
) -> Path:
    """Write a small randomly initialised causal LM (and a tokenizer) with ``save_pretrained``.

    Args:
        folder: Where to write ``config.json``, ``model.safetensors`` and the tokenizer files.
        model_type: A ``transformers`` model type with a causal-LM class.
        with_tokenizer: Also save a tokenizer; without one, the recipes refuse the folder unless asked for byte-level
            tokens (`data.byte_tokenizer: true`).
        **config: Values replacing the small default sizes.

    Returns:
        The folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    sizes: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "vocab_size": 384,
    }
    sizes.update(config)
    if with_tokenizer:
        tokenizer = train_bpe_tokenizer(sizes["vocab_size"])
        sizes.update(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        tokenizer.save_pretrained(folder)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))
    model.save_pretrained(folder)
    return folder
