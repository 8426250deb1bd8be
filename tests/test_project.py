"""Project hygiene: lint, types, and the README's promises kept by CI."""

import os
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


_BUDGET_TESTS = """
import time
import pytest

def test_quick():
    pass

def test_over_the_budget():
    time.sleep(1.5)

@pytest.mark.slow(reason="waits on purpose")
def test_marked_with_its_reason():
    time.sleep(1.5)

@pytest.mark.slow
def test_marked_without_a_reason():
    time.sleep(1.5)
"""


def test_a_test_over_the_budget_fails_unless_marked_slow_with_the_reason(tmp_path):
    """tests/conftest.py's budget per test (SPMD_TEST_BUDGET_S), here 1 s."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_makereport  # noqa: F401\n"
    )
    (tmp_path / "test_budget.py").write_text(_BUDGET_TESTS)
    env = {**os.environ, "SPMD_TEST_BUDGET_S": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rA",
         str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    text = out.stdout
    assert "PASSED test_budget.py::test_quick" in text, text
    assert "PASSED test_budget.py::test_marked_with_its_reason" in text, text
    assert "FAILED test_budget.py::test_over_the_budget" in text, text
    assert re.search(r"test_over_the_budget took 1\.\d s, over the budget of 1 s", text), text
    assert "FAILED test_budget.py::test_marked_without_a_reason" in text, text
    assert "@pytest.mark.slow needs reason=" in text, text
    assert out.returncode == 1, text
