"""Bad input gets one clear, actionable error, and the model is left as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy, host_memory
from lightning_superpipe.memory.host import HostMemoryError
from lightning_superpipe.run import setup
from lightning_superpipe.run.options import KnobError
from lightning_superpipe.streaming import NoBlocksFoundError, find_blocks
from lightning_superpipe.streaming.blocks import assign_parameters
from tests import batches, tasks


def test_registered_under_its_name_and_usable_as_an_instance() -> None:
    trainer = tasks.trainer("superpipe")
    assert isinstance(trainer.strategy, SuperpipeStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer = tasks.trainer(SuperpipeStrategy(resident_blocks=3, prefetch=2))
    assert (trainer.strategy.resident_blocks, trainer.strategy.prefetch) == (3, 2)


def test_several_devices_resolve_to_one_rank_each() -> None:
    # Runs on several devices are tested end to end in tests/test_strategy_ddp.py; here only what the Trainer
    # resolves: two CPU processes launched by Lightning's subprocess launcher, each streaming through one device.
    trainer = tasks.trainer("superpipe", devices=2)
    assert isinstance(trainer.strategy, SuperpipeStrategy)
    assert trainer.strategy.parallel_devices == [torch.device("cpu")] * 2
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    assert tasks.trainer("superpipe").strategy.launcher is None  # one device: this process, no process group


class _Flat(tasks.Task):
    def __init__(self) -> None:
        super().__init__(lambda: nn.Linear(12, 3), "vector")


def test_a_model_without_a_stack_runs_whole_on_the_device_and_says_how_to_name_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    infos: list[str] = []
    monkeypatch.setattr(setup, "rank_zero_info", infos.append)
    runs = []
    for strategy in ("auto", "superpipe"):
        tasks.pl.seed_everything(5, verbose=False)
        task = _Flat()
        tasks.trainer(strategy, max_steps=3).fit(task, batches.data("vector"))
        runs.append(task)
    said = [info for info in infos if "nothing streams" in info]
    assert len(said) == 1 and "SuperpipeStrategy(blocks={MyLayer})" in said[0]
    assert runs[1].losses == runs[0].losses and tasks.max_relative_difference(runs[0], runs[1]) == 0.0


def test_a_share_of_free_memory_on_a_cpu_device_is_refused_as_the_trainer_is_made() -> None:
    # Before the model is built or any data read: the Trainer has chosen the device, which is all the check needs.
    for budget in ("80%", "auto"):
        with pytest.raises(KnobError, match=rf"memory_budget='{budget}'\) takes a share of the device's free memory"):
            tasks.trainer(SuperpipeStrategy(memory_budget=budget))


def test_a_block_policy_that_matches_nothing_says_how_to_name_them() -> None:
    with pytest.raises(NoBlocksFoundError, match=r"SuperpipeStrategy\(blocks=\{MyLayer\}\)"):
        tasks.trainer(SuperpipeStrategy(blocks={nn.Conv2d})).fit(_Flat(), batches.data("vector"))


def test_more_resident_blocks_than_the_model_has_is_an_error_and_a_deep_prefetch_is_clamped() -> None:
    # A count of blocks the model does not have is a mistake (the wrong model, or the wrong knob): said before the run.
    with pytest.raises(MisconfigurationException, match=r"resident_blocks=9\): the model has 4 blocks, so it is"):
        tasks.trainer(SuperpipeStrategy(resident_blocks=9), max_steps=1).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )
    # A prefetch deeper than the blocks that stream fetches them all: the most there is, with a warning.
    strategy = SuperpipeStrategy(resident_blocks=4, prefetch=5)
    with pytest.warns(UserWarning, match=r"prefetch=5\) is more than the number of streamed blocks \(0\); using 0"):
        tasks.trainer(strategy, max_steps=1).fit(tasks.build_task("sequential"), batches.data("vector"))
    assert strategy.memory_report()["resident_blocks"] == 4
    assert strategy.memory_report()["prefetch"] == 0
    with pytest.raises(
        MisconfigurationException, match=r"SuperpipeStrategy\(prefetch=-1\) must be a whole number, zero"
    ):
        tasks.trainer(SuperpipeStrategy(prefetch=-1)).fit(tasks.build_task("sequential"), batches.data("vector"))
    # A boolean is an int to Python, but `resident_blocks=True` is a mistake, not "one block".
    with pytest.raises(MisconfigurationException, match=r"SuperpipeStrategy\(resident_blocks=True\) must be a whole"):
        tasks.trainer(SuperpipeStrategy(resident_blocks=True)).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )


def test_a_host_too_small_is_refused_before_anything_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    task = tasks.build_task("llama")
    before = {name: param.detach().clone() for name, param in task.named_parameters()}
    with pytest.raises(HostMemoryError, match=r"needs about .* more host memory .* only 1 KiB is available"):
        tasks.trainer("superpipe").fit(task, batches.data("lm"))
    for name, param in task.named_parameters():
        assert torch.equal(param, before[name])  # nothing lost


def test_an_error_inside_a_block_leaves_the_parameters_in_place() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(24, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    task = tasks.build_task("sequential")
    task.model[1][2] = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        tasks.trainer(SuperpipeStrategy(blocks={nn.Sequential, Failing}), max_steps=1).fit(task, batches.data("vector"))
    assert isinstance(task.model[1][2].linear.weight, nn.Parameter)
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" for p in task.parameters())


def test_block_discovery_and_policies() -> None:
    llama = tasks.llama()
    assert find_blocks(llama) == list(llama.model.layers)
    # A list of modules of several classes is a stack only if they are transformers decoder layers (hybrids).
    with pytest.raises(NoBlocksFoundError, match="same-type"):
        find_blocks(nn.ModuleDict({"mixed": nn.ModuleList([nn.Linear(4, 4), nn.Conv1d(4, 4, 1)])}))
    decoder_layer = type(llama.model.layers[0])
    assert find_blocks(llama, {decoder_layer}) == list(llama.model.layers)
    assert find_blocks(llama, lambda m: isinstance(m, decoder_layer)) == list(llama.model.layers)
    with pytest.raises(NoBlocksFoundError, match="policy"):
        find_blocks(llama, {nn.Conv2d})
    with pytest.raises(TypeError, match="nn.Module"):
        find_blocks(llama, {int})  # type: ignore[arg-type]


def test_parameters_shared_between_blocks_stay_resident_and_tied() -> None:
    model = tasks.tied()
    stack = model[1]
    shared = stack[0][0]
    blocks = find_blocks(model)
    assert blocks == list(stack)
    per_block, trunk = assign_parameters(model, blocks)
    assert per_block[0] == []  # all of block 0 is shared
    assert [id(p) for p in per_block[1]] == [id(p) for p in stack[1].parameters()]
    assert {id(shared.weight), id(shared.bias)} <= {id(p) for p in trunk}

    plain = tasks.fit("tied", "auto")
    streamed = tasks.fit("tied", SuperpipeStrategy(resident_blocks=0))
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    assert streamed.model[1][0][0] is streamed.model[1][2][1]


def test_default_discovery_streams_every_outermost_stack_in_execution_order() -> None:
    """Every stack of same-type modules that holds parameters streams: here an encoder of 2 and a decoder of 3
    (the deeper one is not chosen alone); stacks inside a block stream with it; a list of one module that holds a
    stack is looked into; parameterless lists (dropouts) are ignored."""

    def layer() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(4)]))

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dropouts = nn.ModuleList([nn.Dropout() for _ in range(6)])
            self.encoder = nn.ModuleList([layer() for _ in range(2)])
            self.wrapper = nn.ModuleList([nn.Sequential(nn.ModuleList([layer() for _ in range(3)]))])

    model = EncoderDecoder()
    assert find_blocks(model) == [*model.encoder, *model.wrapper[0][0]]
    single = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([layer()]))
    assert find_blocks(single) == [single[1][0]]  # a single layer is a stack of one


def test_blocks_of_different_dtypes_are_refused_before_training() -> None:
    task = tasks.build_task("sequential")
    task.model[1][2].half()  # one block in fp16, the others in fp32: they cannot share slots
    with pytest.raises(
        TypeError, match=r"slots of one dtype, but the blocks' weights have \['torch.float16', 'torch.float32'\]"
    ):
        tasks.trainer(SuperpipeStrategy(resident_blocks=0), max_steps=1).fit(task, batches.data("vector"))


def test_cuda_graph_capture_while_streaming_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_superpipe.streaming.copier import Copier

    monkeypatch.setattr(Copier, "capturing", lambda self: True)
    with pytest.raises(RuntimeError, match="cannot stream blocks inside CUDA graph capture"):
        tasks.trainer("superpipe", max_steps=1).fit(tasks.build_task("sequential"), batches.data("vector"))


def test_parameters_replaced_by_new_objects_mid_run_are_refused() -> None:
    """`load_state_dict(assign=True)` swaps the Parameter objects the strategy streams: refused, not ignored."""

    class Reassign(tasks.pl.Callback):
        def on_train_batch_end(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: object
        ) -> None:
            state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            pl_module.load_state_dict(state, assign=True)

    with pytest.raises(RuntimeError, match=r"was replaced by another\s+object during the run .*assign=True"):
        tasks.trainer("superpipe", max_steps=2, callbacks=[Reassign()]).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )


BAD_KNOBS = [
    (dict(prefetch=-1), r"SuperpipeStrategy\(prefetch=-1\) must be a whole number, zero or more\."),
    (dict(resident_blocks=1.5), r"SuperpipeStrategy\(resident_blocks=1\.5\) must be a whole number, zero or more\."),
    (dict(memory_budget="12 apples"), r"SuperpipeStrategy\(memory_budget='12 apples'\): expected bytes such as"),
    (dict(memory_budget=0.9), r"SuperpipeStrategy\(memory_budget=0\.9\): a bare float is ambiguous .* e\.g\. '90%'"),
    (dict(memory_budget=0), r"SuperpipeStrategy\(memory_budget=0\) must be a positive number of bytes\."),
    (dict(activations="stash"), r"SuperpipeStrategy\(activations='stash'\): 'stash' is not one of"),
    (dict(activations=["keep", "stash"]), r"activations=\['keep', 'stash'\]\): 'stash' is not one of"),
    (dict(overlap_optimizer="yes"),
     r"SuperpipeStrategy\(overlap_optimizer='yes'\) must be 'auto', True, False, 'speculative' or 'pipelined'\."),
    (dict(blocks={int}), r"SuperpipeStrategy\(blocks=\{<class 'int'>\}\): `blocks` must hold `nn.Module` subclasses"),
    (dict(blocks="layers"), r"SuperpipeStrategy\(blocks='layers'\): `blocks` must be a set of module classes"),
    (dict(link="lazy"), r"SuperpipeStrategy\(link='lazy'\) must be an `EmulatedLink` or None\."),
    (dict(offload_device="nvme"), r"offload_device='nvme'.*must be 'cpu' .* or 'disk'"),
    (dict(offload_path="/tmp"), r"offload_device='cpu', offload_path='/tmp'.*used only by the disk tier"),
    (dict(offload_device="disk"), r"offload_path=None.*needs offload_path"),
    (dict(offload_device="disk", offload_path="/tmp", host_buffer_bytes=-1), r"host_buffer_bytes must be a positive"),
    (dict(shard_optimizer="yes"), r"SuperpipeStrategy\(shard_optimizer='yes'\) must be True, False or 'node'"),
]


@pytest.mark.parametrize(
    ("knobs", "message"), BAD_KNOBS, ids=[f"{next(iter(knobs))}-{i}" for i, (knobs, _) in enumerate(BAD_KNOBS)]
)
def test_a_bad_knob_fails_in_the_constructor_with_the_users_call(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        SuperpipeStrategy(**knobs)
    assert isinstance(raised.value, MisconfigurationException)  # what the strategy raised for it at fit before


def test_the_strategy_takes_keywords_only_and_keeps_the_knobs_readable() -> None:
    with pytest.raises(TypeError, match="positional"):
        SuperpipeStrategy(None, 1)  # type: ignore[misc]
    strategy = SuperpipeStrategy(prefetch=2, blocks={nn.Linear}, offload_device="disk", offload_path="/nonexistent")
    # The folder is the machine's state when the run starts, checked then (tests/test_strategy_disk.py).
    assert (strategy.prefetch, strategy.block_policy, strategy.offload_device) == (2, {nn.Linear}, "disk")
    assert strategy.shard_optimizer == "auto" and strategy.options.shard_optimizer == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):  # a checked value stays checked
        strategy.options.prefetch = -1  # type: ignore[misc]


def test_the_default_sharding_falls_back_where_one_copy_per_node_is_refused() -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_superpipe.run.options import SuperpipeOptions, default_sharding

    def choose(options: SuperpipeOptions = SuperpipeOptions(), **run: object) -> tuple[object, object]:
        settings = {"precision": "32-true", "averaging": [], "shared_free": 1 << 30, "shared_needed": 1 << 20, **run}
        return default_sharding(options, **settings)  # type: ignore[arg-type]

    assert choose() == ("node", None)
    assert choose(precision="bf16-mixed") == ("node", None)
    disk = SuperpipeOptions(offload_device="disk", offload_path="/tmp")
    assert choose(disk)[0] is False and "the disk tier" in choose(disk)[1]
    assert choose(precision="16-mixed")[0] is False and "16-mixed" in choose(precision="16-mixed")[1]
    averaging = choose(averaging=[EMAWeightAveraging()])
    assert averaging[0] is True and "the callback EMAWeightAveraging" in averaging[1]
    assert choose(shared_free=None) == (True, "this machine has no /dev/shm for the node's shared copy of the blocks")
    small = choose(shared_free=1 << 20, shared_needed=1 << 21)
    assert small[0] is True and "/dev/shm has 1 MiB free" in small[1]


def test_a_block_of_two_dtypes_is_one_clear_error_and_the_model_is_untouched() -> None:
    """A bfloat16 base under LoRA adapters peft made in float32 (its default `autocast_adapter_dtype`): one error
    naming two parameters and the ways out, before anything is allocated, instead of a `TypeError` from the homes."""
    peft = pytest.importorskip("peft")
    task = tasks.build_task("llama")
    task.model = peft.get_peft_model(task.model.to(torch.bfloat16), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    before = {name: (p.dtype, p.data_ptr()) for name, p in task.named_parameters()}
    assert {dtype for dtype, _ in before.values()} == {torch.bfloat16, torch.float32}
    with pytest.raises(MisconfigurationException, match=r"block 0 holds .*q_proj.* in torch\.bfloat16 and .*lora_A"
                       r".* in torch\.float32.*autocast_adapter_dtype=False.*Nothing was allocated"):
        tasks.trainer("superpipe", max_steps=1).fit(task, batches.data("lm"))
    assert {name: (p.dtype, p.data_ptr()) for name, p in task.named_parameters()} == before
