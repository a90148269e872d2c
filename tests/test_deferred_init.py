"""``DeferredInit`` (the disk tier's mode around ``configure_model``): init calls recorded with their generator's
state and replayed later give an eager build's values bitwise, in any order, and the random stream after the build
is the eager one; code inside the mode never sees a value before its init ran."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_superpipe.construction.deferred_init import DeferredInit
from tests.families import FAMILIES


def _build_both(build: object) -> tuple[nn.Module, nn.Module, DeferredInit, bool]:
    torch.manual_seed(0)
    eager = build()
    after_eager = torch.rand(8)
    torch.manual_seed(0)
    with DeferredInit() as deferred:
        built = build()
    same_stream = torch.equal(torch.rand(8), after_eager)
    return eager, built, deferred, same_stream


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replayed_values_are_the_eager_builds_bitwise_and_the_parameters_stay_untouched(family: str) -> None:
    eager, built, deferred, same_stream = _build_both(FAMILIES[family].build)
    assert same_stream  # the scratch runs drew what the eager calls drew
    params = dict(built.named_parameters())
    pending = {name for name, p in params.items() if p.untyped_storage().data_ptr() in deferred._pending}
    assert pending  # every family initializes something through an init function
    # Replayed in reverse order: each call runs with its own generator state, so order does not matter.
    values = {}
    for name in reversed(list(params)):
        values.update(deferred.initial_values({name: params[name]}))
    deferred.materialize(built.buffers())
    # Left: the parameters' records (kept in case the tier fails) and those of tensors the model no longer holds (a
    # head replaced by a tied one); the strategy drops them once the tier stands.
    assert not {b.untyped_storage().data_ptr() for b in built.buffers()} & set(deferred._pending)
    for name, param in eager.named_parameters():
        assert torch.equal(values[name], param), name
    for (name, buffer), (_, ours) in zip(eager.named_buffers(), built.named_buffers()):
        assert torch.equal(ours, buffer), name
    shared = {p.untyped_storage().data_ptr() for p in params.values() if p.untyped_storage().nbytes() > 0}
    untouched = [n for n in pending if values[n].untyped_storage().data_ptr() not in shared]
    assert len(untouched) >= len(pending) // 2  # fresh tensors, apart from parameters that share or split storage


def test_code_inside_the_mode_sees_initialized_values_and_what_it_loads_stays() -> None:
    torch.manual_seed(0)
    eager = nn.Linear(8, 8)
    torch.manual_seed(0)
    with DeferredInit() as deferred:
        layer = nn.Linear(8, 8)
        total = layer.weight.sum()  # a read: the pending calls run into the weight first
        loaded = nn.Linear(8, 8)
        loaded.load_state_dict({"weight": torch.full((8, 8), 3.0), "bias": torch.zeros(8)})
    assert torch.equal(total, eager.weight.sum())
    assert torch.equal(layer.weight, eager.weight)
    deferred.materialize(loaded.parameters())
    assert torch.equal(loaded.weight, torch.full((8, 8), 3.0)) and torch.equal(loaded.bias, torch.zeros(8))
    # A view's write after the weight's init: replayed in order, into a fresh tensor too.
    torch.manual_seed(1)
    eager = nn.Embedding(6, 4, padding_idx=2)
    torch.manual_seed(1)
    with DeferredInit() as deferred:
        embedding = nn.Embedding(6, 4, padding_idx=2)
    (value,) = deferred.initial_values({"weight": embedding.weight}).values()
    assert torch.equal(value, eager.weight) and not value[2].any()


def _saved(family: str, folder: object) -> nn.Module:
    torch.manual_seed(3)
    model = FAMILIES[family].build()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "opt", "phi", "falcon", "gpt_neox", "qwen2"])
def test_load_safetensors_under_the_mode_reads_each_tensor_when_it_is_asked_for(family: str, tmp_path: object) -> None:
    """A model built from its config under the mode, then given a saved folder: nothing is read until a tensor's
    values are asked for, and then each is ``from_pretrained``'s, bitwise; tied weights need no tensor of their own."""
    from transformers import AutoModelForCausalLM

    from lightning_superpipe import load_safetensors

    saved = _saved(family, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    with DeferredInit() as deferred:
        built = AutoModelForCausalLM.from_config(saved.config)
        assert load_safetensors(built, tmp_path) == []
    params = dict(built.named_parameters())
    values = deferred.initial_values(params)
    for name, param in reference.named_parameters():
        assert torch.equal(values[name], param), name
    eager = AutoModelForCausalLM.from_config(saved.config)  # outside the mode: loaded at once
    load_safetensors(eager, tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(eager.parameters(), reference.parameters()))


def test_load_safetensors_refuses_a_layout_that_transformers_converts(tmp_path: object) -> None:
    from lightning_superpipe import load_safetensors

    saved = _saved("mixtral", tmp_path)
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.0\.mlp\.experts.*fused experts"):
        load_safetensors(type(saved)(saved.config), tmp_path)
    # strict=False loads what matches and names the rest, which keeps its init.
    partial = type(saved)(saved.config)
    missing = load_safetensors(partial, tmp_path, strict=False)
    assert missing and all(".mlp." in name for name in missing)
    ours, theirs = dict(partial.named_parameters()), dict(saved.named_parameters())
    assert all(torch.equal(ours[name], theirs[name]) for name in ours if name not in missing)
    with pytest.raises(ValueError, match="no such file .*nothing-here"):
        load_safetensors(saved, tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_safetensors(saved, tmp_path / "empty")


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "t5"])
def test_save_safetensors_writes_what_from_pretrained_reads_one_tensor_at_a_time(family: str, tmp_path: object) -> None:
    """Beside the config ``save_pretrained`` writes, the file ``save_safetensors`` writes is a model ``from_pretrained``
    loads bitwise; a tied weight is written once, under its first name; ``dtype`` casts only floating-point tensors."""
    import json

    from safetensors.torch import load_file

    from lightning_superpipe import save_safetensors

    saved = _saved(family, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    aliases = save_safetensors(saved, tmp_path / "model.safetensors")
    state = saved.state_dict()
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(name for name in state if name not in aliases)
    assert all(torch.equal(written[name], state[name]) for name in written)
    tied = [name for name in aliases if state[name].data_ptr() in {state[n].data_ptr() for n in written}]
    assert tied == aliases  # only names that are another's tensor are left out
    assert bool(aliases) == bool(getattr(saved.config, "tie_word_embeddings", False))
    loaded = type(saved).from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    save_safetensors(saved, tmp_path / "half.safetensors", dtype=torch.bfloat16)
    half = load_file(tmp_path / "half.safetensors")
    assert all(half[n].dtype == (torch.bfloat16 if state[n].is_floating_point() else state[n].dtype) for n in half)
    assert all(torch.equal(half[n], state[n].to(half[n].dtype)) for n in half)
    header = json.loads((tmp_path / "half.safetensors").read_bytes()[8:][: int.from_bytes(
        (tmp_path / "half.safetensors").read_bytes()[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}


def test_save_safetensors_refuses_tensors_without_values_and_leaves_no_file_when_writing_fails(
    tmp_path: object,
) -> None:
    from lightning_superpipe import save_safetensors
    from lightning_superpipe.memory.disk import DiskTierError, write_safetensors

    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="weight holds no values"):
        save_safetensors(meta, tmp_path / "meta.safetensors")
    parked = nn.Linear(4, 4)
    parked.weight.data = torch.zeros(()).expand(4, 4)  # a disk tier's placeholder, outside its run (no hook)
    with pytest.raises(ValueError, match=r"weight holds no values .* placeholder of the disk tier outside its run"):
        save_safetensors(parked, tmp_path / "parked.safetensors")
    with pytest.raises(DiskTierError, match="missing"):
        save_safetensors(nn.Linear(4, 4), tmp_path / "missing" / "model.safetensors")
    with pytest.raises(ValueError, match=r"b has shape \(3,\), not shape \(2,\)"):
        write_safetensors(tmp_path / "short.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))],
                          [torch.zeros(2), torch.zeros(3)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, whole or partial
