"""Lightning's own tests, run plainly and under ``SuperpipeStrategy``: the counts, and each test that passes plainly
but fails under the strategy, with its cause, except those listed in ``conformance.txt`` beside this file (tests that
assert what legitimately differs: the strategy's class, a mock of a method the strategy does not call, ...).

    python tests/lightning_suite/compare.py PLAIN.xml SUPERPIPE.xml

The two files are the JUnit XML reports of the same selection of Lightning's tests (``pytest --junitxml``; the
harness that runs them is described in docs/benchmarks/compatibility.md). Exits 1 if a test fails under the strategy
that passes plainly and is not listed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

CONFORMANCE = Path(__file__).with_name("conformance.txt")
_WORST_FIRST = {"failed": 3, "error": 2, "skipped": 1, "passed": 0}


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome (``passed``, ``failed``, ``error``, ``skipped``) and its message's first line, by
    ``module::name`` (``tests_pytorch/x/test_y.py::test_z[param]``); a test reported twice counts as its worst."""
    found: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        key = f"{module}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome, message = name, (element.get("message") or "").strip().splitlines()[:1]
                message = message[0] if message else ""
                break
        if key not in found or _WORST_FIRST[outcome] > _WORST_FIRST[found[key][0]]:
            found[key] = (outcome, message)
    return found


def conformance(path: Path = CONFORMANCE) -> dict[str, str]:
    """The listed tests (an id, or an id's prefix ending in ``*``) and why each legitimately differs."""
    listed = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test, _, reason = line.partition(" # ")
            listed[test.strip()] = reason.strip()
    return listed


def reason_for(test: str, listed: dict[str, str]) -> str | None:
    """Why ``test`` is listed, or ``None``."""
    for pattern, reason in listed.items():
        if test == pattern or (pattern.endswith("*") and test.startswith(pattern[:-1])):
            return reason
    return None


def regressions(plain: dict[str, tuple[str, str]], ours: dict[str, tuple[str, str]]) -> list[str]:
    """The tests that pass plainly and fail, error or are missing under the strategy."""
    return sorted(test for test, (outcome, _) in plain.items()
                  if outcome == "passed" and ours.get(test, ("missing", ""))[0] in ("failed", "error", "missing"))


def main(argv: list[str]) -> int:
    plain, ours = outcomes(Path(argv[0])), outcomes(Path(argv[1]))
    for name, run in (("plain", plain), ("superpipe", ours)):
        counts = Counter(outcome for outcome, _ in run.values())
        print(f"{name}: {counts['passed']} passed, {counts['failed'] + counts['error']} failed,"
              f" {counts['skipped']} skipped")
    listed = conformance()
    failing = regressions(plain, ours)
    expected = [test for test in failing if reason_for(test, listed) is not None]
    unexpected = [test for test in failing if reason_for(test, listed) is None]
    print(f"pass plainly, fail under superpipe: {len(failing)} ({len(expected)} listed in conformance.txt,"
          f" {len(unexpected)} not)")
    by_cause = Counter(ours.get(test, ("missing", "missing"))[1][:100] for test in unexpected)
    for cause, count in by_cause.most_common():
        print(f"  {count:4d}  {cause}")
    for test in unexpected:
        print(f"  {test}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
