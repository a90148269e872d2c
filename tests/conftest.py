"""Test-wide settings."""

import os
import zlib

# Bit-for-bit comparisons need a math library that gives the same bits for the same operation wherever the operands
# sit in memory. MKL does not on some CPUs (on an AMD EPYC, GPT-2 streamed gave gradients that differed from plain
# Lightning's in the last bits) unless its conditional numerical reproducibility is on. Set before torch
# loads MKL; subprocesses (the DDP and kill -9 workers) inherit it.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402
import torch  # noqa: E402

from lightning_superpipe import EmulatedLink, SuperpipeStrategy

# The models under test are tiny: one thread is faster than two, and CI's two cores are shared with other
# processes, where OpenMP threads oversubscribing them made the suite ten times slower.
torch.set_num_threads(1)


_EMULATED_MODES = ("lazy", "thread")
# By default each case runs on one emulated mode (alternating through a function's cases, so every function with two
# or more cases meets both): the second mode took a quarter of the suite's time (197 of 787 s serially) and finds the
# same ordering bugs through the checker. `SUPERPIPE_TEST_LINKS=all` runs every case on both, before a release or
# after a change to the engine's ordering.
_LINKS = os.environ.get("SUPERPIPE_TEST_LINKS", "one").lower()
if _LINKS not in ("one", "all"):
    raise pytest.UsageError(f"SUPERPIPE_TEST_LINKS={_LINKS!r}: use 'one' (the default) or 'all'")
_ALL_LINKS = _LINKS == "all"


@pytest.fixture(params=["cpu", *_EMULATED_MODES])
def emulated_link(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on the plain CPU link and on the emulated asynchronous link, so that the engine's CUDA code paths
    (deferred copies, events, staging, the gradient worker) and the happens-before checker see every streaming test.
    Strategies the test builds without a `link=` get the emulated one. Each case runs on one of the emulated modes,
    or with `SUPERPIPE_TEST_LINKS=all` on both (see `pytest_collection_modifyitems`)."""
    if request.param != "cpu":
        original = SuperpipeStrategy.__init__

        def with_link(self: SuperpipeStrategy, *args: object, link: object = None, **kwargs: object) -> None:
            link = link if link is not None else EmulatedLink(mode=request.param, seed=0, max_delay_s=2e-4)
            original(self, *args, link=link, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(SuperpipeStrategy, "__init__", with_link)
    return request.param


def _emulated_mode_of_case(function: str, case: int) -> str:
    """The emulated mode a case runs on: alternating through a test function's cases, from a start fixed by its
    name, so that every function with two or more cases sees both modes and a single run of one file chooses as
    the whole suite does."""
    return _EMULATED_MODES[(zlib.crc32(function.encode()) + case) % len(_EMULATED_MODES)]


# The files that take longest (after each, its seconds in a loaded 2-core run), longest first. pytest-xdist hands whole
# files to its workers in collection order (pyproject turns off its reordering by number of tests, which put the
# files of a few long tests, such as the kill -9 chain, last: one worker then ran them alone for minutes), so these
# start first and the many short files fill in the end.
_LONGEST_FIRST = (
    "test_strategy_disk.py",  # 338
    "test_strategy_ddp.py",  # 245, two processes a run
    "test_recipes_cli.py",  # 150
    "test_lightning_suite.py",  # 45, Lightning's own tests in one process of their own
    "test_disk_crash.py",  # 146, nine processes one after the other
    "test_step_modes.py",  # 139
    "test_strategy_lifecycle.py",  # 130
    "test_strategy_activations.py",  # 120
    "test_strategy_families.py",  # 110
    "test_recipes_resume.py",  # 107
    "test_planner_solver.py",  # 105
    "test_moe_families.py",  # 105
    "test_optimizer_overlap.py",  # 96
    "test_moe_paging.py",  # 96
    "test_strategy_habits.py",  # 83
    "test_strategy_exactness.py",  # 82
    "test_strategy_disk_families.py",  # 66
    "test_moe_streaming.py",  # 60
    "test_moe_callback.py",  # 50, one test
    "test_strategy_memory.py",  # 40
)


@pytest.hookimpl(tryfirst=True)  # before `-k`/`-m` deselect, so a case's position does not depend on them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts the files of :data:`_LONGEST_FIRST` first, in that order (each file's tests in their own order).

    Unless `SUPERPIPE_TEST_LINKS=all`, keeps each case of an `emulated_link` test on the CPU link and on one
    emulated mode. The two modes find the same ordering bugs through the checker (which tracks events, not timing);
    `lazy` also runs every copy as late as possible and `thread` runs them concurrently, so each test function still
    meets both across its cases."""
    rank = {name: position for position, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in collection order
    if _ALL_LINKS:
        return
    cases: dict[str, list[str]] = {}
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        mode = callspec.params.get("emulated_link") if callspec is not None else None
        if mode not in _EMULATED_MODES:
            kept.append(item)
            continue
        function = f"{item.path}::{item.originalname}"
        case = "-".join(part for part in callspec.id.split("-") if part not in _EMULATED_MODES)
        known = cases.setdefault(function, [])
        if case not in known:
            known.append(case)
        (kept if _emulated_mode_of_case(function, known.index(case)) == mode else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    return "emulated link: " + (
        "every case on both modes" if _ALL_LINKS else "each case on one mode (SUPERPIPE_TEST_LINKS=all: both)"
    )
