"""The documentation cannot drift from the code: its examples run, and its references name everything public.

* The README's quick start and each guide's main example (the fences marked ``<!-- docs-test: run -->``) run here on
  the CPU, and every ``memory_report()`` key they produce has a row in the reference.
* Every name of ``lightning_superpipe.__all__`` and of the subpackages' ``__all__`` has an API entry, and every knob a
  row in the knob reference.
* Every message the package raises has a line in the troubleshooting page.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import lightning_superpipe
from lightning_superpipe import SuperpipeOptions, SuperpipeStrategy
from tests.docs_sources import DOCS, ROOT, Example, documented_examples, examples, raise_sites

SUBPACKAGES = ("strategies", "run", "streaming", "planning", "memory", "moe", "generation", "sequence", "recipes")
EXAMPLES = documented_examples()


def _report_keys(namespace: dict[str, object]) -> set[str]:
    """The ``memory_report()`` keys of the strategy an example ran, if it ran one."""
    strategies = [value for value in namespace.values() if isinstance(value, SuperpipeStrategy)]
    trainer = namespace.get("trainer")
    strategies += [trainer.strategy] if isinstance(getattr(trainer, "strategy", None), SuperpipeStrategy) else []
    return {key for strategy in strategies for key in strategy.memory_report()}


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.name}-{i}" for i, e in enumerate(EXAMPLES)])
def test_example_runs(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each marked example runs as written, in a folder of its own; its report's keys are all documented."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if example.as_script:
        script = tmp_path / "example.py"
        script.write_text(example.code)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        return
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(example.code, example.name, "exec"), namespace)  # noqa: S102 - the documented code itself
    reference = (DOCS / "reference" / "memory-report.md").read_text()
    missing = sorted(key for key in _report_keys(namespace) if f"| `{key}` |" not in reference)
    assert not missing, f"memory_report() keys without a row in docs/reference/memory-report.md: {missing}"


def test_readme_and_every_guide_have_a_running_example() -> None:
    """The README's quick start and each guide's main example are marked, so that the test above runs them."""
    pages = [ROOT / "README.md", *sorted((DOCS / "guides").glob("*.md"))]
    unmarked = [str(page.relative_to(ROOT)) for page in pages if not examples(page)]
    assert not unmarked, f"pages without a `<!-- docs-test: run -->` example: {unmarked}"


def test_every_public_name_has_an_api_entry() -> None:
    """``::: lightning_superpipe.NAME`` for the package's names, ``::: lightning_superpipe.SUB.NAME`` for each
    subpackage's, so that mkdocstrings renders each one (and the strict build fails on a name that does not exist)."""
    top = (DOCS / "reference" / "api.md").read_text()
    subs = (DOCS / "reference" / "api-subpackages.md").read_text()
    missing = [name for name in lightning_superpipe.__all__ if f"::: lightning_superpipe.{name}\n" not in top]
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"lightning_superpipe.{sub}")
        missing += [f"{sub}.{name}" for name in module.__all__ if f"::: lightning_superpipe.{sub}.{name}\n" not in subs]
    assert not missing, f"public names without an API entry: {missing}"


def test_every_knob_has_a_row() -> None:
    """Every field of ``SuperpipeOptions`` has a row, with its type and default, in the knob reference."""
    reference = (DOCS / "reference" / "knobs.md").read_text()
    missing = [f.name for f in dataclasses.fields(SuperpipeOptions) if f"| `{f.name}` |" not in reference]
    assert not missing, f"knobs without a row in docs/reference/knobs.md: {missing}"


def test_every_error_message_has_a_troubleshooting_line() -> None:
    """Every ``raise`` with a literal message in the package has its longest literal stretch in the page."""
    page = (DOCS / "troubleshooting.md").read_text().replace("\\", "")  # Markdown escapes (`\\*`) aside
    sites = raise_sites()
    assert len(sites) > 100  # the collector reads the package's raises (a broken collector would find none)
    missing = [f"{s.module}:{s.line} {s.error}: {s.key!r}" for s in sites if s.key not in page]
    assert not missing, "errors without a line in docs/troubleshooting.md:\n" + "\n".join(missing)


def test_the_troubleshooting_check_notices_a_new_message(tmp_path: Path) -> None:
    """Messages the page lacks are found: raised or made by a helper, in f-strings and concatenations."""
    from tests import docs_sources

    package = tmp_path / "lightning_superpipe"
    package.mkdir()
    (package / "new.py").write_text(
        "def check(x):\n"
        "    raise ValueError(f'SuperpipeStrategy(new_knob={x!r}) must be '\n"
        "                     + 'a brand new kind of value, never seen before')\n"
        "def _new_error(path):\n"
        "    return DiskTierError(f'The file {path} grew a brand new problem overnight.')\n"
    )
    original = (docs_sources.ROOT, docs_sources.PACKAGE)
    docs_sources.ROOT, docs_sources.PACKAGE = tmp_path, package
    try:
        sites = sorted(docs_sources.raise_sites(), key=lambda site: site.line)
    finally:
        docs_sources.ROOT, docs_sources.PACKAGE = original
    assert [(site.error, site.key) for site in sites] == [
        ("ValueError", "a brand new kind of value, never seen before"),
        ("DiskTierError", "grew a brand new problem overnight"),
    ]
    page = (DOCS / "troubleshooting.md").read_text()
    assert not any(site.key in page for site in sites)
