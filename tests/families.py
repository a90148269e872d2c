"""A library of tiny models from many ``transformers`` families (and a few plain ``torch`` ones), with their data
(:mod:`tests.batches`) and their loss, to train each one with plain Lightning and with the superpipe strategy
(:func:`tests.tasks.fit_family`) and compare the two in fp32.

Every model is built the way a new user builds one: ``AutoModel*.from_config`` on the family's config with its
DEFAULT values for ``use_cache``, the attention implementation (sdpa unless a variant says ``eager``), dropout,
tied embeddings and so on; only the sizes are shrunk (and special token ids brought inside the tiny vocabulary).
Nothing is downloaded: weights are random, drawn from the caller's seed.

Usage::

    from tests import tasks

    plain = tasks.fit_family("llama-padded", "auto")
    streamed = tasks.fit_family("llama-padded", "superpipe")
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5

``FAMILIES`` maps a name to a :class:`Family`; :func:`causal_lm` makes other variants of the causal LMs
(``causal_lm("qwen2", padding="left", attn="eager")``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tests.batches import SEQ, VOCAB, image_data, lm_data, seq2seq_data, vector_data, vlm_data

Batch = Mapping[str, Tensor]


# --------------------------------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class Family:
    """One tiny model with its data and its loss.

    Attributes:
        name: The key in :data:`FAMILIES`.
        build: Builds the model (random weights from the caller's seed; calls no seeding itself).
        kind: How batches look: ``"causal_lm"`` (``input_ids``, ``labels``, and ``attention_mask`` when padded),
            ``"seq2seq"`` (``input_ids``, ``labels``, maybe ``attention_mask``), ``"vlm"`` (``pixel_values``,
            ``input_ids`` with the image tokens, ``labels``), ``"image"`` (``pixel_values``, ``labels``) or
            ``"vector"`` (``x``, ``labels``).
        data: ``data(batches, seed)`` returns a :class:`DataLoader` of ``batches`` micro-batches (dicts of
            tensors), the same for the same seed.
        loss: ``loss(model, batch)`` returns the scalar training loss.
        padding: ``"left"``/``"right"`` when some rows are padded (``attention_mask`` 0 and ``labels`` -100
            there), else ``None``.
        attn: The ``attn_implementation`` asked for, ``None`` for the family's default (sdpa where supported).
        tags: Free-form markers tests can select on: ``"hf"``, ``"lm"``, ``"moe"``, ``"batchnorm"``, ``"tied"``,
            ``"dropout"``, ``"encoder-decoder"``, ``"vision"``, ``"single-block"``, ``"empty-modulelist"``,
            ``"unused-params"`` (some parameters get no gradient in some steps).
        notes: What the family exercises, for humans.
    """

    name: str
    build: Callable[[], nn.Module]
    kind: str
    data: Callable[[int, int], DataLoader]
    loss: Callable[[nn.Module, Batch], Tensor]
    padding: str | None = None
    attn: str | None = None
    tags: frozenset[str] = field(default_factory=frozenset)
    notes: str = ""

    def batch(self, seed: int = 0) -> dict[str, Tensor]:
        """One micro-batch (the first of ``data(1, seed)``)."""
        return next(iter(self.data(1, seed)))


def hf_loss(model: nn.Module, batch: Batch) -> Tensor:
    """The loss a ``transformers`` model computes itself from ``labels``."""
    return model(**batch).loss


def cross_entropy_loss(model: nn.Module, batch: Batch) -> Tensor:
    """For plain torch models: ``model(x)`` are the logits."""
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


# ------------------------------------------------------------------------------------------- causal LM families


def _llama_like(config_class: str, layers: int, **extra: Any) -> Callable[[], Any]:
    def config() -> Any:
        import transformers

        options = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2 * SEQ,
        )
        options.update(extra)
        return getattr(transformers, config_class)(**options)

    return config


def _gemma_config(config_class: str, layers: int, **extra: Any) -> Callable[[], Any]:
    # Gemma's head_dim (256) and query_pre_attn_scalar are sizes, not derived from hidden_size/heads.
    return _llama_like(config_class, layers, head_dim=8, **extra)


def _gpt2_config(layers: int) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=layers, n_head=4, bos_token_id=1, eos_token_id=2
    )


def _gpt_neox_config(layers: int) -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=2 * SEQ,
    )


def _phi_config(layers: int) -> Any:
    from transformers import PhiConfig

    return PhiConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=2 * SEQ,
    )


def _phi3_config(layers: int) -> Any:
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, original_max_position_embeddings=2 * SEQ,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _opt_config(layers: int) -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=2 * SEQ, word_embed_proj_dim=32,
    )


def _falcon_config(layers: int) -> Any:
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, bos_token_id=1,
        eos_token_id=2,
    )


def _mixtral_config(layers: int) -> Any:
    from transformers import MixtralConfig

    # 8 experts, top-1: with 2 x 8 tokens a micro-batch leaves some experts without a token.
    return MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, num_local_experts=8, num_experts_per_tok=1,
    )


def _jamba_config(layers: int) -> Any:
    from transformers import JambaConfig

    # A hybrid: Mamba layers and attention layers (different classes in one stack), MoE every other layer.
    return JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=max(layers, 2), num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, num_experts=4, num_experts_per_tok=1,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8,
        mamba_dt_rank=8, use_mamba_kernels=False,
    )


def _qwen2_moe_config(layers: int) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, num_experts=8, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=32,
    )


# name -> (config factory taking the number of layers, tags, notes)
CAUSAL_LMS: dict[str, tuple[Callable[[int], Any], frozenset[str], str]] = {
    "llama": (lambda n: _llama_like("LlamaConfig", n)(), frozenset(), "GQA, RoPE, RMSNorm, untied head"),
    "qwen2": (lambda n: _llama_like("Qwen2Config", n)(), frozenset(), "llama with q/k/v biases"),
    "mistral": (
        lambda n: _llama_like("MistralConfig", n, sliding_window=8)(), frozenset(),
        "llama with a sliding window (shrunk from 4096 to 8 < seq 16, so that it masks something)",
    ),
    "gemma": (lambda n: _gemma_config("GemmaConfig", n)(), frozenset({"tied"}), "tied embeddings, scaled embedding"),
    "gemma2": (
        lambda n: _gemma_config("Gemma2Config", n, sliding_window=8)(), frozenset({"tied"}),
        "logit soft-capping, sliding/full layers alternating, tied",
    ),
    "gemma3": (
        lambda n: _gemma_config("Gemma3TextConfig", n, sliding_window=8)(), frozenset({"tied"}),
        "q/k norms, sliding-window layers (window 8 < seq 16), two RoPEs, tied",
    ),
    "gpt2": (_gpt2_config, frozenset({"tied", "dropout"}), "absolute positions, Conv1D, dropout 0.1, tied"),
    "gpt_neox": (_gpt_neox_config, frozenset(), "parallel residual, partial rotary"),
    "phi": (_phi_config, frozenset(), "parallel attention/MLP, partial rotary, LayerNorm"),
    "phi3": (_phi3_config, frozenset(), "fused qkv and gate/up projections"),
    "opt": (
        _opt_config, frozenset({"tied", "dropout"}), "learned positions from the attention mask, dropout 0.1, tied"
    ),
    "falcon": (_falcon_config, frozenset({"tied"}), "multi-query, parallel attention, tied"),
    "mixtral": (
        _mixtral_config, frozenset({"moe"}), "8 experts top-1 in fused 3-D parameters (unused experts get zero grads)"
    ),
    "qwen2_moe": (
        _qwen2_moe_config, frozenset({"moe"}),
        "8 experts top-1 plus a gated shared expert, fused 3-D expert parameters",
    ),
    "jamba": (
        _jamba_config, frozenset({"moe"}),
        "hybrid: a Mamba layer then an attention layer (two classes in one stack), experts in the first",
    ),
}


def _pad_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def causal_lm(
    arch: str, *, padding: str | None = None, attn: str | None = None, layers: int = 2, name: str | None = None,
) -> Family:
    """A causal LM family from :data:`CAUSAL_LMS`.

    Args:
        arch: A key of :data:`CAUSAL_LMS` (``"llama"``, ``"gpt2"``, ...).
        padding: ``"left"`` or ``"right"`` to pad every row of a micro-batch but the first (with the config's pad
            id, ``attention_mask`` 0 and ``labels`` -100 there); ``None`` for full rows and no mask.
        attn: ``attn_implementation`` (``"eager"``, ``"sdpa"``); ``None`` keeps ``from_config``'s default (sdpa).
        layers: Decoder layers.
        name: The family's name; by default ``arch`` with ``-eager``/``-padded``/``-left-padded`` appended.
    """
    make_config, tags, notes = CAUSAL_LMS[arch]
    pad_id = _pad_id(make_config(layers))
    moe = "moe" in tags

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        options = {} if attn is None else {"attn_implementation": attn}
        return AutoModelForCausalLM.from_config(make_config(layers), **options)

    def data(batches: int, seed: int) -> DataLoader:
        shape = dict(batch_size=2, seq=8) if moe else {}
        return lm_data(batches, seed, padding=padding, pad_id=pad_id, **shape)

    if name is None:
        name = arch + ("" if attn is None else f"-{attn}")
        name += {None: "", "right": "-padded", "left": "-left-padded"}[padding]
        name += "" if layers == 2 else f"-{layers}layer"
    extra = {"single-block"} if layers == 1 else set()
    return Family(
        name=name, build=build, kind="causal_lm", data=data, loss=hf_loss, padding=padding, attn=attn,
        tags=frozenset({"hf", "lm"} | set(tags) | extra), notes=notes,
    )


# --------------------------------------------------------------------------------------- encoder-decoder families


def t5(padding: str | None = None) -> Family:
    def config() -> Any:
        from transformers import T5Config

        # T5Config() has no decoder_start_token_id in transformers 5 (the hub's t5 configs set 0, the pad id):
        # without it, training from labels fails in T5ForConditionalGeneration._shift_right.
        return T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
            decoder_start_token_id=0,
        )

    def build() -> nn.Module:
        from transformers import AutoModelForSeq2SeqLM

        return AutoModelForSeq2SeqLM.from_config(config())

    return Family(
        name="t5" + ("-padded" if padding else ""), build=build, kind="seq2seq",
        data=lambda batches, seed: seq2seq_data(batches, seed, padding=padding, pad_id=0), loss=hf_loss,
        padding=padding, tags=frozenset({"hf", "encoder-decoder", "tied", "dropout"}),
        notes="2 encoder and 3 decoder blocks (the longest ModuleList is the decoder's), relative positions, "
        "dropout 0.1",
    )


def bart(padding: str | None = None) -> Family:
    def build() -> nn.Module:
        from transformers import AutoModelForSeq2SeqLM, BartConfig

        config = BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=2 * SEQ,
        )
        return AutoModelForSeq2SeqLM.from_config(config)

    return Family(
        name="bart" + ("-padded" if padding else ""), build=build, kind="seq2seq",
        data=lambda batches, seed: seq2seq_data(batches, seed, padding=padding, pad_id=1), loss=hf_loss,
        padding=padding, tags=frozenset({"hf", "encoder-decoder", "tied", "dropout"}),
        notes="2 + 2 blocks of two different classes, learned positions, dropout 0.1, tied embeddings",
    )


# ---------------------------------------------------------------------------------------------- vision-language

LLAVA_IMAGE_TOKEN = VOCAB - 1


def llava() -> Family:
    """CLIP (2 layers, 16x16 images of 8x8 patches: 4 image tokens) + a 3-layer llama, through llava's
    projector; the vision tower uses layer -2 and drops CLS (llava's defaults)."""

    def build() -> nn.Module:
        from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

        vision = CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
            patch_size=8, projection_dim=32,
        )
        text = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2 * SEQ,
        )
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN)
        return AutoModelForImageTextToText.from_config(config)

    return Family(
        name="llava", build=build, kind="vlm",
        data=lambda batches, seed: vlm_data(
            batches, seed, image_token=LLAVA_IMAGE_TOKEN, image_tokens=4, image_size=16
        ),
        loss=hf_loss, tags=frozenset({"hf", "lm", "vision"}),
        notes="two block stacks of different classes (2 CLIP + 3 llama layers), image features scattered into the "
        "embeddings",
    )


PALIGEMMA_IMAGE_TOKEN = VOCAB - 1


def paligemma() -> Family:
    """SigLIP (2 layers, 16x16 images of 8x8 patches: 4 image tokens) + a 2-layer gemma."""

    def build() -> nn.Module:
        from transformers import AutoModelForImageTextToText, GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

        vision = SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
            patch_size=8,
        )
        text = GemmaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=2 * SEQ,
        )
        config = PaliGemmaConfig(
            vision_config=vision, text_config=text, image_token_index=PALIGEMMA_IMAGE_TOKEN, projection_dim=32,
        )
        return AutoModelForImageTextToText.from_config(config)

    return Family(
        name="paligemma", build=build, kind="vlm",
        data=lambda batches, seed: vlm_data(
            batches, seed, image_token=PALIGEMMA_IMAGE_TOKEN, image_tokens=4, image_size=16, prompt=3
        ),
        loss=hf_loss, tags=frozenset({"hf", "lm", "vision", "tied"}),
        notes="SigLIP + gemma; with token_type_ids the prefix (bos, image, prompt) attends bidirectionally",
    )


# --------------------------------------------------------------------------------------------- vision (BatchNorm)


def resnet() -> Family:
    def build() -> nn.Module:
        from transformers import AutoModelForImageClassification, ResNetConfig

        config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 2, 1], num_labels=5)
        return AutoModelForImageClassification.from_config(config)

    return Family(
        name="resnet", build=build, kind="image", data=lambda batches, seed: image_data(batches, seed, size=32),
        loss=hf_loss, tags=frozenset({"hf", "vision", "batchnorm"}),
        notes="bottleneck stages full of BatchNorm2d (running stats are buffers that training changes)",
    )


def _conv_bn() -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1))

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(*[block() for _ in range(3)]), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(8, 5),
    )


def conv_bn() -> Family:
    return Family(
        name="conv-bn", build=_conv_bn, kind="image", data=lambda batches, seed: image_data(batches, seed, size=8),
        loss=lambda model, batch: nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"]),
        tags=frozenset({"vision", "batchnorm", "dropout"}),
        notes="plain nn.Sequential: 3 repeated Conv2d/BatchNorm2d/ReLU/Dropout blocks",
    )


# ------------------------------------------------------------------------------------------------ odd structures


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class DropoutListModel(nn.Module):
    """The longest uniform ``nn.ModuleList`` is 6 parameter-free ``nn.Dropout``; the real blocks are a
    ``nn.ModuleList`` of 3 residual MLPs beside it."""

    def __init__(self, features: int = 12, width: int = 24, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.drops = nn.ModuleList([nn.Dropout(0.1) for _ in range(6)])
        self.blocks = nn.ModuleList([_Residual(width) for _ in range(3)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = self.drops[2 * i + 1](block(self.drops[2 * i](x)))
        return self.head(x)


def dropout_list() -> Family:
    return Family(
        name="dropout-list", build=DropoutListModel, kind="vector", data=vector_data, loss=cross_entropy_loss,
        tags=frozenset({"empty-modulelist", "dropout"}), notes=DropoutListModel.__doc__ or "",
    )


class _Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([_Expert(width) for _ in range(experts)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        weight, index = probs.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (index == e).nonzero(as_tuple=True)
            if rows[0].numel():  # an expert with no token is not called: its parameters get no gradient
                out = out.index_put(rows, expert(h[rows]) * weight[rows].unsqueeze(-1))
        return x + out


class ModuleListMoE(nn.Module):
    """Token-wise LM: embeddings, 2 :class:`MoEBlock` (top-1 routing over a ``nn.ModuleList`` of 8 expert MLPs),
    a head. Experts that get no token are never called, so their parameters keep ``grad=None`` for that
    micro-batch. Note that the longest uniform ``nn.ModuleList`` is a block's 8 experts, not the 2 blocks: pass
    ``blocks={MoEBlock}`` to stream the blocks."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, experts: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([MoEBlock(width, experts) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _next_token_loss(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(batch["input_ids"])[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))


def moe_modulelist() -> Family:
    return Family(
        name="moe-modulelist", build=ModuleListMoE, kind="causal_lm",
        data=lambda batches, seed: lm_data(batches, seed, batch_size=2, seq=8), loss=_next_token_loss,
        tags=frozenset({"moe", "unused-params"}), notes=ModuleListMoE.__doc__ or "",
    )


# ---------------------------------------------------------------------------------------------------- the registry


def _registry() -> dict[str, Family]:
    variants: list[Family] = [
        causal_lm("llama"),
        causal_lm("llama", padding="right"),
        causal_lm("llama", padding="left"),
        causal_lm("llama", attn="eager"),
        causal_lm("llama", attn="eager", padding="right"),
        causal_lm("llama", attn="eager", padding="left"),
        causal_lm("llama", layers=1),
        causal_lm("qwen2"),
        causal_lm("qwen2", padding="left"),
        causal_lm("mistral"),
        causal_lm("mistral", attn="eager", padding="right"),
        causal_lm("gemma"),
        causal_lm("gemma", padding="right"),
        causal_lm("gemma2"),
        causal_lm("gemma3"),
        causal_lm("gemma3", attn="eager", padding="left"),
        causal_lm("gpt2"),
        causal_lm("gpt2", padding="right"),
        causal_lm("gpt2", attn="eager", padding="left"),
        causal_lm("gpt_neox"),
        causal_lm("gpt_neox", padding="right"),
        causal_lm("phi"),
        causal_lm("phi3"),
        causal_lm("phi3", padding="left"),
        causal_lm("opt"),
        causal_lm("opt", padding="right"),
        causal_lm("falcon"),
        causal_lm("falcon", padding="left"),
        causal_lm("mixtral"),
        causal_lm("qwen2_moe"),
        causal_lm("jamba"),
        moe_modulelist(),
        t5(),
        t5(padding="right"),
        bart(),
        bart(padding="right"),
        llava(),
        paligemma(),
        resnet(),
        conv_bn(),
        dropout_list(),
    ]
    return {family.name: family for family in variants}


FAMILIES: dict[str, Family] = _registry()


def select(*tags: str, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the families having every tag in ``tags`` and none in ``exclude``."""
    excluded = set(exclude)
    return [name for name, f in FAMILIES.items() if set(tags) <= f.tags and not (excluded & f.tags)]


def get(name: str | Family) -> Family:
    """The family called ``name`` (a :class:`Family` is returned as is)."""
    return name if isinstance(name, Family) else FAMILIES[name]
