"""The emulated asynchronous device: it defers copies, catches unordered accesses, and is not a no-op.

The mutation check at the end seeds the ordering bugs a GPU would punish into the engine's source, one at a
time: each must fail under the emulated link in both modes, and pass on the plain (synchronous) CPU link, which
is why the emulator exists.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_superpipe  # noqa: F401
from lightning_superpipe import EmulatedLink, OrderingViolation, SuperpipeStrategy
from lightning_superpipe.emulation.link import parse_bandwidth
from lightning_superpipe.memory import host as host_module
from lightning_superpipe.streaming import engine as engine_module
from lightning_superpipe.streaming import gradients as gradients_module
from tests import batches, tasks

CPU = torch.device("cpu")


@contextmanager
def _copier(**options: Any) -> Iterator[Any]:
    copier = EmulatedLink(**options).copier(CPU)
    try:
        yield copier
    finally:
        copier.close()


# ---------------------------------------------------------------------------------------------------- the copier


def test_lazy_copies_run_only_when_waited_for_and_destinations_read_nan_before() -> None:
    with _copier(mode="lazy", check=False) as copier:
        src, dst = torch.arange(8.0), torch.zeros(8)
        event = copier.to_device(dst, src, copier.mark_compute(), "dst")
        assert torch.isnan(dst).all()  # issued, not run: a reader that did not wait sees NaN
        copier.wait_on_compute(event)
        assert torch.equal(dst, src)


def test_thread_copies_run_on_their_own_stream_threads() -> None:
    with _copier(mode="thread", max_delay_s=0.01, check=False) as copier:
        src, dst = torch.arange(8.0), torch.zeros(8)
        copier.wait_on_host(copier.to_host(dst, src, "dst"))
        assert torch.equal(dst, src)
        assert {t.name for t in threading.enumerate()} >= {"emulated-h2d", "emulated-d2h"}


def test_thread_copies_keep_the_issuers_inference_mode_and_a_failed_copy_raises_in_the_waiter() -> None:
    with _copier(mode="thread", max_delay_s=0.01, check=False) as copier:
        with torch.inference_mode():  # buffers made in evaluation loops are inference tensors, and so is the mode
            dst = torch.zeros(8)
            copier.wait_on_compute(copier.to_device(dst, torch.arange(8.0), copier.mark_compute(), "slot"))
        assert torch.equal(dst, torch.arange(8.0))
        # Outside inference mode the same copy is refused on the issuing thread, as torch refuses it there.
        with pytest.raises(RuntimeError, match="inference tensor"):
            copier.to_device(dst, torch.ones(8), copier.mark_compute(), "slot")
        # A copy that fails on its stream's thread (shapes that do not broadcast) raises in the waiter instead of
        # leaving it waiting for ever.
        event = copier.to_device(torch.zeros(8), torch.ones(3), copier.mark_compute(), "bad")
        with pytest.raises(RuntimeError, match="emulated h2d stream failed"):
            copier.wait_on_compute(event)


def test_reading_a_copied_buffer_without_waiting_is_a_violation() -> None:
    with _copier() as copier:
        src, dst = torch.arange(8.0), torch.zeros(8)
        copier.wait_on_compute(copier.to_device(dst, torch.zeros(8), copier.mark_compute(), "slot A"))
        dst.sum()  # waited: fine
        copier.to_device(dst, src, copier.mark_compute(), "slot A")
        with pytest.raises(OrderingViolation, match=r"read after write: .*aten\.sum.* slot A .*without waiting"):
            dst.sum()


def test_a_view_at_an_offset_is_checked_too() -> None:
    """The CUDA sanitizer keys on data pointers, so a view at an offset has no history; here ranges count."""
    with _copier() as copier:
        flat = torch.zeros(64)
        copier.to_device(flat[16:48], torch.ones(32), copier.mark_compute(), "the middle of a slot")
        flat[:16].sum()  # outside the copy: fine
        with pytest.raises(OrderingViolation, match="the middle of a slot"):
            flat[40:].sum()  # overlaps the copy's destination


def test_a_copy_into_memory_compute_used_must_be_issued_after_that_use() -> None:
    with _copier() as copier:
        buffer = torch.zeros(16)
        free = copier.mark_compute()
        buffer.add_(1)  # compute uses the buffer after the event
        with pytest.raises(OrderingViolation, match=r"write after read: a copy into slot B was issued after compute"):
            copier.to_device(buffer, torch.ones(16), free, "slot B")
        with pytest.raises(OrderingViolation, match="issued after no event"):
            copier.to_device(torch.zeros(16), torch.ones(16), None, "a fresh slot")  # the allocator may reuse memory
        copier.to_device(buffer, torch.ones(16), copier.mark_compute(), "slot B")  # ordered: fine


@pytest.mark.parametrize("when", ["queued", "ran"])
def test_freeing_device_memory_a_copy_may_still_write_is_a_violation(when: str) -> None:
    # On a GPU a freed buffer goes to the next allocation on the compute stream, and a copy still in flight into it
    # overwrites that: compute must wait for the copy before going on. Queued: the link holds the destination until
    # its copy runs; ran: the emulated copy is done, but compute never waited for it.
    options = dict(mode="lazy") if when == "queued" else dict(mode="thread", max_delay_s=0.0)
    with _copier(**options) as copier:
        dst = torch.zeros(16)
        event = copier.to_device(dst, torch.ones(16), copier.mark_compute(), "a buffer waited for")
        del dst
        copier.wait_on_compute(event)  # freed, then waited for before compute goes on: fine
        torch.ones(4).sum()
        dst = torch.zeros(16)
        event = copier.to_device(dst, torch.ones(16), copier.mark_compute(), "an activation brought back")
        if when == "ran":
            while copier._executed["h2d"] < event.seq:
                time.sleep(0.001)
        del dst
        with pytest.raises(OrderingViolation, match=r"an activation brought back was freed while copy #2 on h2d"):
            torch.ones(4).sum()


def test_a_host_write_into_a_source_in_flight_taints_what_the_copy_wrote() -> None:
    with _copier() as copier:
        src, dst = torch.arange(8.0), torch.zeros(8)
        event = copier.to_device(dst, src, copier.mark_compute(), "slot C")
        src.add_(1)  # the host writes the source while the copy may still read it
        copier.wait_on_compute(event)
        with pytest.raises(OrderingViolation, match="the host wrote the source of copy"):
            dst.sum()
        copier.wait_on_compute(copier.to_device(dst, src, copier.mark_compute(), "slot C"))
        dst.sum()  # a clean copy replaced the unreliable data


def test_a_source_holding_nan_is_tainted_only_when_written() -> None:
    """Gradients under a gradient scaler's overflowing scale hold NaN and inf: an untouched source is no write
    (``torch.equal`` calls NaN unequal to itself), while writing one, even into a NaN, still is."""
    with _copier() as copier:
        src, dst = torch.tensor([float("nan"), float("inf"), 1.0, 2.0]), torch.zeros(4)
        copier.wait_on_compute(copier.to_device(dst, src, copier.mark_compute(), "slot N"))
        assert torch.isnan(dst[0]) and dst[1:].tolist() == [float("inf"), 1.0, 2.0]  # read: no violation
        event = copier.to_device(dst, src, copier.mark_compute(), "slot N")
        src[2] = float("nan")
        copier.wait_on_compute(event)
        with pytest.raises(OrderingViolation, match="the host wrote the source of copy"):
            dst.sum()


def test_the_bandwidth_cap_makes_copies_take_their_time() -> None:
    assert parse_bandwidth("8GB/s") == 8e9
    assert parse_bandwidth("500 MiB/s") == 500 * 2**20
    assert parse_bandwidth(1e9) == 1e9
    for bad in ("fast", -1, 0, True):
        with pytest.raises((ValueError, TypeError), match="bandwidth"):
            parse_bandwidth(bad)  # type: ignore[arg-type]
    link = EmulatedLink(bandwidth="100MB/s", check=False)
    copier = link.copier(CPU)
    try:
        src = torch.zeros(2_500_000)  # 10 MB: 0.1 s at 100 MB/s
        started = time.perf_counter()
        event = copier.to_device(torch.empty_like(src), src, copier.mark_compute())
        issued = time.perf_counter()
        copier.wait_on_compute(event)
        assert time.perf_counter() - started >= 0.099
        # The wait counts from when it began: all of the copy's time but what issuing it took (loaded cores: ms).
        assert link.stats.wait_seconds >= 0.099 - (issued - started) and link.stats.bytes == 10_000_000
    finally:
        copier.close()


def test_bad_arguments_and_a_gpu_are_refused_with_the_users_call() -> None:
    with pytest.raises(ValueError, match=r"EmulatedLink\(mode='eager'\) must be 'lazy' or 'thread'"):
        EmulatedLink(mode="eager")
    with pytest.raises(ValueError, match="emulates an asynchronous device on the CPU"):
        EmulatedLink().copier(torch.device("cuda", 0))
    with pytest.raises(MisconfigurationException, match=r"link='lazy'\) must be an `EmulatedLink`"):
        strategy = SuperpipeStrategy(link="lazy")  # type: ignore[arg-type]  # refused here, by the constructor
        tasks.trainer(strategy, max_steps=1).fit(tasks.build_task("sequential"), batches.data("vector"))


@pytest.mark.parametrize("mode", ["lazy", "thread"])
def test_the_engine_takes_its_asynchronous_paths_and_stays_exact(mode: str) -> None:
    threads: set[str] = set()
    original = gradients_module.GradientReturn._accumulate

    def recording(self: Any, *args: Any) -> None:
        threads.add(threading.current_thread().name)
        original(self, *args)

    link = EmulatedLink(mode=mode)
    plain = tasks.plain_fit("gpt2")  # once for both modes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gradients_module.GradientReturn, "_accumulate", recording)
        streamed = tasks.fit("gpt2", SuperpipeStrategy(resident_blocks=0, prefetch=1, link=link))
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    assert threads and all(name.startswith("superpipe-gradients") for name in threads)  # the worker added them
    assert link.stats.copies > 100 and link.stats.waits > 100 and not link.stats.violations


# ---------------------------------------------------------------------------------------------------- mutations


@contextmanager
def _mutated(module: Any, cls: str, method: str, old: str, new: str) -> Iterator[None]:
    """Replaces one line of ``cls.method``'s source for the duration (the line must be there: if the engine
    changes, the mutation check fails instead of silently testing nothing)."""
    target = getattr(module, cls)
    source = inspect.getsource(getattr(target, method))
    assert source.count(old) == 1, f"{cls}.{method} no longer contains {old!r}: update the mutation check"
    indent = len(source) - len(source.lstrip())
    body = "\n".join(line[indent:] for line in source.replace(old, new).splitlines())
    namespace: dict[str, Any] = {}
    exec(compile(body, f"<mutated {cls}.{method}>", "exec"), vars(module), namespace)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target, method, namespace[method])
        yield


MUTATIONS = {
    "no wait before reading a slot": (
        engine_module, "StreamingEngine", "acquire_flat", "self.copier.wait_on_compute(slot.ready)", "pass",
    ),
    "load into a slot with no after event": (
        host_module, "BlockHome", "copy_in", "link.to_device(dst, self.transfer, after, what)",
        "link.to_device(dst, self.transfer, None, what)",
    ),
    "the worker skips its wait for the copy": (
        gradients_module, "GradientReturn", "_accumulate", "self.copier.wait_on_host(done)", "pass",
    ),
    "the trunk is read without waiting": (
        engine_module, "StreamingEngine", "trunk_tensor", "self.copier.wait_on_compute(self._trunk_ready)", "pass",
    ),
}


def _streamed_fit(link: Any) -> tasks.Task:
    return tasks.fit("llama", SuperpipeStrategy(resident_blocks=0, prefetch=1, link=link), max_steps=3)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_seeded_ordering_bug_fails_under_the_emulator_and_passes_on_the_plain_cpu(mutation: str) -> None:
    plain = tasks.plain_fit("llama", max_steps=3)  # once for the four mutations
    with _mutated(*MUTATIONS[mutation]):
        # The synchronous CPU link cannot see it: this is the bug class the emulator is for.
        unnoticed = _streamed_fit(None)
        assert tasks.max_relative_difference(unnoticed, plain) < 1e-5
        for mode in ("lazy", "thread"):
            with pytest.raises(OrderingViolation):
                _streamed_fit(EmulatedLink(mode=mode, seed=1))
