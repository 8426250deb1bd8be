"""The README's first code block runs as written: alone (a world of one) and on 2 ranks."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SPMD_RUN = [sys.executable, "-m", "spmd.cli.run"]


def _first_block() -> str:
    found = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert found is not None, "the README has no python block"
    return found.group(1)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_first_block_trains(tmp_path, ranks):
    script = tmp_path / "first.py"
    script.write_text(_first_block())
    launcher = [] if ranks == 1 else [*SPMD_RUN, "-n", str(ranks)]
    out = subprocess.run([*launcher, sys.executable, str(script)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(rf"rank 0 of {ranks}: loss ([\d.e+-]+)", out.stdout)
    assert found is not None, out.stdout
    assert float(found.group(1)) < 1e-3, out.stdout  # the fit is exact: y = x @ [0..7] + 1
    # The op list shows the gradients' allreduce where there is more than one rank.
    assert ("allreduce" in out.stdout) == (ranks > 1), out.stdout
