"""Finding the blocks of a model: the repeated modules that stream through the device one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Union

from torch import nn

#: How a user names the blocks: module classes (every outermost instance is a block) or a predicate, in the
#: style of FSDP's ``activation_checkpointing_policy``. ``None`` finds them automatically.
BlockPolicy = Union[
    set[type[nn.Module]], list[type[nn.Module]], tuple[type[nn.Module], ...], Callable[[nn.Module], bool]
]


class NoBlocksFoundError(ValueError):
    """Raised when a model has no blocks to stream and the user did not name any."""


def find_blocks(model: nn.Module, policy: BlockPolicy | None = None) -> list[nn.Module]:
    """Returns the model's blocks in execution order.

    By default the blocks are the members of every *stack* of the model: an ``nn.ModuleList`` or ``nn.Sequential``
    of one or more same-type modules, or of ``transformers`` decoder layers of several types (a hybrid model's
    attention and state-space layers), that holds parameters (the decoder layers of a ``transformers`` model; the
    encoder's and the decoder's layers of an encoder-decoder; the vision tower's and the language model's layers
    of a vision-language model; the stages of a vision model; a user's stack). Only outermost stacks count (a stack
    inside a block streams with its block), except that a stack whose single member is a stack itself is looked
    into. A policy overrides that: a collection of module classes selects every outermost instance of
    those classes; a callable selects every outermost module for which it returns ``True``. Order is the order of
    ``model.modules()``, which is the execution order for sequential stacks (the engine re-synchronises when a
    model calls its blocks in another order).

    Args:
        model: The model to search.
        policy: Module classes or a predicate naming the blocks, or ``None`` for automatic discovery.

    Raises:
        NoBlocksFoundError: If nothing qualifies; the message says how to name the blocks.
    """
    if policy is None:
        blocks = [block for stack in _outermost_stacks(model) for block in stack]
    else:
        predicate = _as_predicate(policy)
        blocks = outermost(model, predicate)
    blocks = [block for block in blocks if _has_parameters(block)]
    if not blocks:
        how = "found no `nn.ModuleList`/`nn.Sequential` of same-type modules with parameters"
        if policy is not None:
            how = f"the block policy {policy!r} matched no module with parameters"
        raise NoBlocksFoundError(
            f"SuperpipeStrategy {how} in {type(model).__name__}. Name the blocks to stream explicitly, e.g."
            " `SuperpipeStrategy(blocks={MyLayer})` with your layer class, or"
            " `SuperpipeStrategy(blocks=lambda module: isinstance(module, MyLayer))`."
        )
    return blocks


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if not children or not _has_parameters(module):
        return False
    # Hybrid models (Jamba: attention and Mamba layers) mix layer classes in one stack; transformers marks every
    # decoder layer as a GradientCheckpointingLayer, which says they run one after another.
    return len({type(child) for child in children}) == 1 or all(_is_decoder_layer(child) for child in children)


def _is_decoder_layer(module: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: same-type stacks only
        return False
    return isinstance(module, GradientCheckpointingLayer)


def _outermost_stacks(model: nn.Module) -> list[list[nn.Module]]:
    stacks: list[list[nn.Module]] = []

    def visit(module: nn.Module) -> None:
        if _is_stack(module):
            children = list(module.children())
            lone = children[0]
            if len(children) > 1 or not _is_stack(lone):
                stacks.append(children)
                return
        for child in module.children():
            visit(child)

    visit(model)
    return stacks


def describe_stacks(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """Where the blocks are, one entry per run of blocks under the same parent, e.g.
    ``['model.encoder.block: 2 x T5Block', 'model.decoder.block: 4 x T5Block']``."""
    names = {id(module): name for name, module in model.named_modules()}
    runs: list[tuple[str, list[nn.Module]]] = []
    for block in blocks:
        name = names.get(id(block), "?")
        parent = name.rpartition(".")[0] or "(top level)"
        if runs and runs[-1][0] == parent:
            runs[-1][1].append(block)
        else:
            runs.append((parent, [block]))
    return [f"{parent}: {describe(members)}" for parent, members in runs]


def _as_predicate(policy: BlockPolicy) -> Callable[[nn.Module], bool]:
    if isinstance(policy, (set, list, tuple, frozenset)):
        classes = tuple(policy)
        if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
            raise TypeError(f"`blocks` must hold `nn.Module` subclasses, got {policy!r}.")
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(f"`blocks` must be a set of module classes or a callable, got {policy!r}.")


def outermost(model: nn.Module, predicate: Callable[[nn.Module], bool], include_model: bool = False) -> list[nn.Module]:
    """Modules under ``model`` (``model`` too with ``include_model``) matching ``predicate`` that are not inside
    another match (blocks must not nest)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if predicate(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    for root in [model] if include_model else model.children():
        visit(root)
    return found


def describe(blocks: Iterable[nn.Module]) -> str:
    """A short human description, e.g. ``'24 x LlamaDecoderLayer'``."""
    blocks = list(blocks)
    names = sorted({type(block).__name__ for block in blocks})
    return f"{len(blocks)} x {'/'.join(names)}"


def assign_parameters(
    model: nn.Module, blocks: list[nn.Module], mixed_precision: bool = False
) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """Splits the model's parameters into those that stream with each block and the resident rest.

    A parameter streams with a block only if that block alone uses it; one shared with the rest of the model or
    with another block (tied weights) stays resident, so that it stays tied. Under ``mixed_precision`` only
    matrices stream (they travel in the compute dtype, what autocast casts them to before each matmul anyway);
    vectors (norms, biases) and embedding tables stay fp32 and resident, as autocast keeps them, so the step
    matches plain mixed precision.

    Returns:
        The streamed parameters of each block, in block order, and the resident ("trunk") parameters.
    """
    lookups = {p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}

    def streams(param: nn.Parameter) -> bool:
        return not mixed_precision or (param.ndim >= 2 and param not in lookups)

    users: dict[nn.Parameter, set[int]] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            users.setdefault(param, set()).add(index)
    outside = {param for param in _parameters_outside(model, blocks)}
    per_block: list[list[nn.Parameter]] = [[] for _ in blocks]
    for param, owners in users.items():
        if len(owners) == 1 and param not in outside and streams(param):
            per_block[next(iter(owners))].append(param)
    streamed = {param for params in per_block for param in params}
    trunk = [param for param in model.parameters() if param not in streamed]
    return per_block, trunk


def _parameters_outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Parameter]:
    inside = {id(block) for block in blocks}
    found: list[nn.Parameter] = []

    def visit(module: nn.Module) -> None:
        if id(module) in inside:
            return
        found.extend(module._parameters[name] for name in module._parameters if module._parameters[name] is not None)
        for child in module.children():
            visit(child)

    visit(model)
    return found
