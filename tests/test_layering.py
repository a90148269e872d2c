"""The package's shape, checked by the tools made for it: import-linter's contracts and ruff's rules (pyproject.toml).

Both run on the whole tree, so a change that imports upward (memory importing streaming), closes an import cycle, or
breaks a lint rule fails the suite, with the tool's own report as the message.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_the_rooms_depend_downward_and_no_module_imports_one_that_imports_it_back() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint_imports is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = _run(lint_imports, "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing() -> None:
    pytest.importorskip("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr
