"""The tutorials (tutorials/*.ipynb) run top to bottom in a fresh kernel, every error fatal, and
print what their committed outputs show.

Each notebook is executed with nbclient in a kernel of this Python, in a scratch working
directory (its ``%%writefile`` cells and saved files land there). Then every code cell's text
output (standard output and results; standard error is not compared: it carries warnings that
depend on the machine) is compared with the committed one: the text around the numbers exactly,
the numbers to a relative 1e-2 (the last digits of a loss depend on the CPU and the XLA
version; a wrong sum, gradient or average changes far more). A cell tagged ``varies`` is run but
not compared.

To refresh the committed outputs after editing a notebook: ``python tests/test_tutorials.py``
(all of them) or ``python tests/test_tutorials.py tutorials/NAME.ipynb``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_KERNEL = "spmd-tutorials"


def execute(path: Path, workdir: Path) -> Any:
    """The notebook at ``path`` executed in a fresh kernel of this Python, run in ``workdir``."""
    import nbformat
    from nbclient import NotebookClient

    # A kernel spec of our own, so that a "python3" kernel of another environment is not used.
    specs = workdir / "kernels" / _KERNEL
    specs.mkdir(parents=True)
    (specs / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "spmd tutorials",
                "language": "python",
            }
        )
    )
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name=_KERNEL,
        resources={"metadata": {"path": str(workdir)}},
        record_timing=False,
    )
    before = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(workdir)  # where kernels/<name> is looked up first
    try:
        client.execute()
    finally:
        if before is None:
            del os.environ["JUPYTER_PATH"]
        else:
            os.environ["JUPYTER_PATH"] = before
    return notebook


def text_outputs(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream" and out["name"] == "stdout":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def differences(expected: str, got: str, rtol: float = 1e-2) -> list[str]:
    """Where ``got`` differs from ``expected``: the text between numbers must be equal, the
    numbers close."""
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", got):
        return [f"expected:\n{expected}\ngot:\n{got}"]
    found = []
    for a, b in zip(_NUMBER.findall(expected), _NUMBER.findall(got), strict=True):
        if not math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=1e-6):
            found.append(f"{b} where the committed output has {a}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs_and_shows_its_committed_output(path: Path, tmp_path: Path) -> None:
    import nbformat

    committed = nbformat.read(path, as_version=4)
    ran = execute(path, tmp_path)
    checked = 0
    for i, (want, got) in enumerate(zip(committed.cells, ran.cells, strict=True)):
        if want.cell_type != "code" or "varies" in want.metadata.get("tags", []):
            continue
        expected = text_outputs(want)
        problems = differences(expected, text_outputs(got))
        assert not problems, f"{path.name} cell {i}:\n" + "\n".join(problems)
        checked += bool(expected)
    assert checked >= 3  # the committed notebook has outputs to compare


def test_there_are_tutorials() -> None:
    assert [p.name for p in NOTEBOOKS][:2] == ["01_collectives.ipynb", "02_data_parallel.ipynb"]


def test_output_comparison() -> None:
    assert differences("loss 0.5012\n[rank 1] 10.0", "loss 0.5030\n[rank 1] 10.0") == []
    wrong = differences("[rank 0] 10.0", "[rank 0] 3.0")
    assert wrong == ["3.0 where the committed output has 10.0"]
    assert differences("[3. 3.]", "[3. 3. 3.]")  # another shape: the text differs
    assert differences("identical: True", "identical: False")


def refresh(paths: list[Path]) -> None:
    """Executes each notebook and writes it back with its new outputs."""
    import nbformat

    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            notebook = execute(path, Path(tmp))
        nbformat.write(notebook, path)
        print(f"refreshed {path.relative_to(ROOT)}")


if __name__ == "__main__":
    refresh([Path(p).resolve() for p in sys.argv[1:]] or NOTEBOOKS)
