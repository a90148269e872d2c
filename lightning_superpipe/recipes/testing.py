"""A local model folder like one downloaded from the Hugging Face Hub, built offline, for trying ``pretrained_path``.

Nothing is downloaded: the model has random weights from a small config, and the tokenizer is a byte-pair encoding
trained in about a second on Python's documentation (``pydoc_data.topics``), optionally with a ChatML chat template
like an instruction-tuned model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_superpipe.recipes.text_data import embedded_documents

#: ChatML, as Qwen's instruction-tuned models write conversations; roles other than these three are refused, as the
#: templates of Llama and Mistral refuse them.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
#: The control tokens of :data:`CHATML_TEMPLATE`.
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def train_bpe_tokenizer(vocab_size: int = 384, chat: bool = False) -> Any:
    """A ``transformers`` fast tokenizer trained on the embedded corpus, with ``<s>``, ``</s>`` and ``<pad>``.

    Args:
        vocab_size: Size of the vocabulary, special tokens included.
        chat: Add the ChatML control tokens and :data:`CHATML_TEMPLATE`, with ``<|im_end|>`` as the end-of-sequence
            token, as an instruction-tuned model's tokenizer has them.

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
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.add_special_tokens(list(CHATML_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        chat_template=CHATML_TEMPLATE,
    )


def save_tiny_pretrained(
    folder: str | Path, model_type: str = "llama", with_tokenizer: bool = True, chat: bool = False, **config: Any
) -> Path:
    """Write a small randomly initialised causal LM (and a tokenizer) with ``save_pretrained``.

    Args:
        folder: Where to write ``config.json``, ``model.safetensors`` and the tokenizer files.
        model_type: A ``transformers`` model type with a causal-LM class.
        with_tokenizer: Also save a tokenizer; without one, the recipes refuse the folder unless asked for byte-level
            tokens (`data.byte_tokenizer: true`).
        chat: Give the tokenizer a chat template (:func:`train_bpe_tokenizer`).
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
        tokenizer = train_bpe_tokenizer(sizes["vocab_size"], chat=chat)
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
