"""Project hygiene: lint, types, and the README's promises kept by CI."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _tool(name):
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return exe


def test_ruff():
    out = subprocess.run(
        [_tool("ruff"), "check", "src", "tests", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(
        [_tool("ruff"), "format", "--check", "src", "tests", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_on_the_package():
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _readme_command(heading):
    text = (ROOT / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```(?:bash|sh)\n(.*?)\n```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_command("Run the whole test suite")
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci


def test_changelog_has_an_unreleased_section():
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


def test_environment_variables_are_documented():
    """Every SPMD_ variable the package reads is listed in docs/environment.md."""
    used = set()
    for path in (ROOT / "src" / "spmd").rglob("*.py"):
        used |= set(re.findall(r"\"(SPMD_[A-Z_]+)\"", path.read_text()))
    documented = set(
        re.findall(r"`(SPMD_[A-Z_]+)`", (ROOT / "docs" / "environment.md").read_text())
    )
    internal = {
        "SPMD_TESTING_ADDR", "SPMD_TESTING_DIR", "SPMD_RUN_STATUS_DIR", "SPMD_RUN_OUTPUT_DIR",
        "SPMD_TEST_HOSTS_PREFIX",
    }  # fmt: skip
    assert used - internal <= documented, sorted(used - internal - documented)
