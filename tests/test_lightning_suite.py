"""Part of Lightning's own test suite, run with every single-device Trainer switched to ``SuperpipeStrategy``.

Lightning's tests state what its users expect of a Trainer, written by people who are not us. The harness that runs
them under the strategy lives beside the repository (``../shared/peer/lightning``: Lightning 2.6.5's
``tests/tests_pytorch`` and a pytest plugin that substitutes the strategy; ``SUPERPIPE_LIGHTNING_SUITE`` points
elsewhere). This test runs a few of its modules, chosen to cover the habits the strategy once broke (pruning,
iterator-style steps, SLURM signals, hook order and the checkpoint dict, mocks of ``Strategy.backward``),
and fails on any test that fails under the strategy unless ``tests/lightning_suite/conformance.txt`` lists it. The
whole comparison is a documented command (docs/benchmarks/compatibility.md). Skipped where the harness is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lightning_suite.compare import conformance, outcomes, reason_for

ROOT = Path(__file__).resolve().parent.parent
HARNESS = Path(os.environ.get("SUPERPIPE_LIGHTNING_SUITE", ROOT.parent / "shared" / "peer" / "lightning"))

#: Lightning's test modules run here (the full selection takes about 20 minutes on 2 cores).
SUBSET = (
    "tests_pytorch/callbacks/test_pruning.py",
    "tests_pytorch/loops/test_fetchers.py",
    "tests_pytorch/trainer/connectors/test_signal_connector.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py",
)
#: Tests of those modules that do not use the strategy and take long (a DDP run of explicit `strategy="ddp"`).
LEFT_OUT = ("tests_pytorch/callbacks/test_pruning.py::test_pruning_callback_ddp_cpu",)


@pytest.mark.skipif(not (HARNESS / "superpipe_everywhere.py").is_file(),
                    reason=f"Lightning's test harness is not at {HARNESS} (set SUPERPIPE_LIGHTNING_SUITE)")
def test_lightning_s_own_tests_pass_under_the_strategy(tmp_path: Path) -> None:
    report = tmp_path / "blocks.xml"
    # One thread, as the suite's own processes (tests/conftest.py): the other worker keeps its core.
    env = {**os.environ, "SUPERPIPE_MODE": "blocks", "PYTHONPATH": str(HARNESS), "OMP_NUM_THREADS": "1"}
    tests = HARNESS / "tests"
    command = [sys.executable, "-m", "pytest", *(str(tests / module) for module in SUBSET), f"--rootdir={tests}",
               *(f"--deselect={test}" for test in LEFT_OUT), "-p", "superpipe_everywhere", "-p", "no:cacheprovider",
               "-q", "--color=no", "-o", "addopts=", f"--junitxml={report}"]
    # In a folder of its own: some of Lightning's tests write into the working directory, and the harness's is
    # not ours to write into.
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert report.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    results = outcomes(report)
    listed = conformance()
    failed = {test: message for test, (outcome, message) in results.items() if outcome in ("failed", "error")}
    unexpected = {test: message for test, message in failed.items() if reason_for(test, listed) is None}
    assert sum(outcome == "passed" for outcome, _ in results.values()) > 150, run.stdout[-3000:]
    assert not unexpected, "\n".join(f"{test}: {message}" for test, message in unexpected.items())
