"""The tutorials (tutorials/*.ipynb) run top to bottom in a fresh kernel, every error fatal, and
print what their committed outputs show.

Each notebook is executed with nbclient in a kernel of this Python, in a scratch working
directory (its ``%%writefile`` cells and saved files land there). Then every code cell's text
output (standard output and results) is compared with the committed one:

- integers exactly, other numbers to a relative 1e-2 (the last digits of a loss depend on the
  CPU and the XLA version; a wrong sum, gradient or average changes far more), and the text
  around them exactly up to the width of white space (numpy pads its columns);
- in a printed op list (``spmd.trace``), only spmd's own ops: JAX's ops and the numbering of
  the values depend on JAX's version.

Standard error is not compared (it carries warnings that depend on the machine and the
versions installed), but it must hold no traceback and none of spmd's errors or warnings. A
cell tagged ``varies`` is run but not compared.

To refresh the committed outputs after editing a notebook: ``python tests/test_tutorials.py``
(all of them) or ``python tests/test_tutorials.py tutorials/NAME.ipynb``.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
# "0..31" is two integers (a range), not the floats "0." and ".31".
_NUMBER = re.compile(r"[-+]?(?:\d+\.(?!\.)\d*|(?<![\d.])\.\d+|\d+)(?:[eE][-+]?\d+)?")
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


def text_outputs(cell: dict, stream: str = "stdout") -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream" and out["name"] == stream:
            parts.append(out["text"])
        elif stream == "stdout" and out["output_type"] in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


_RANK_PREFIX = re.compile(r"^\[rank \d+\] ?")


def normalize(text: str) -> str:
    """The output without JAX's ops in printed op lists (between a ``def @name(...) {`` line
    and its ``}``, only lines with spmd's ops are kept), value names numbered alike, and white
    space collapsed (also inside brackets, as numpy pads)."""
    kept, inside = [], False
    for line in text.splitlines():
        body = _RANK_PREFIX.sub("", line).strip()
        if not inside and body.startswith("def @") and body.endswith("{"):
            inside = True
        elif inside and body == "}":
            inside = False
        elif not inside or "spmd." in body:
            kept.append(line)
    text = re.sub(r"%x_\d+", "%x", "\n".join(kept))
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\[ +", "[", re.sub(r" +\]", "]", text))


def differences(expected: str, got: str, rtol: float = 1e-2) -> list[str]:
    """Where ``got`` differs from ``expected`` (both normalized): the text between numbers must
    be equal, integers equal, other numbers close."""
    expected, got = normalize(expected), normalize(got)
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", got):
        return [f"expected:\n{expected}\ngot:\n{got}"]
    found = []
    for a, b in zip(_NUMBER.findall(expected), _NUMBER.findall(got), strict=True):
        integers = [not set(".eE") & set(t) for t in (a, b)]
        if integers[0] or integers[1]:
            same = a == b
        else:
            same = math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=1e-9)
        if not same:
            found.append(f"{b} where the committed output has {a}")
    return found


# On standard error: a traceback, spmd's own errors and warnings. Other libraries' warnings
# (deprecations of a newer version) are let through.
_TROUBLE = ("Traceback", "SpmdError", "SpmdTypeError", "PerExampleGradientWarning")


def machine_details(text: str) -> list[str]:
    """Absolute paths and this machine's name in ``text``."""
    found = re.findall(r"(?:^|[\s'\"(=])(/[\w.-]+/[\w./-]+)", text)
    host = socket.gethostname()
    return found + ([host] if len(host) > 3 and host in text else [])


# 05 trains a model on 4 ranks with tensor and expert parallelism, and draws figures.
_SLOW = {"05_tensor_and_expert_parallel": "4-rank tensor and expert parallel training, figures"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.stem, marks=[pytest.mark.slow(reason=_SLOW[p.stem])])
        if p.stem in _SLOW
        else pytest.param(p, id=p.stem)
        for p in NOTEBOOKS
    ],
)
def test_tutorial_runs_and_shows_its_committed_output(path: Path, tmp_path: Path) -> None:
    import nbformat

    committed = nbformat.read(path, as_version=4)
    ran = execute(path, tmp_path)
    checked = 0
    for i, (want, got) in enumerate(zip(committed.cells, ran.cells, strict=True)):
        if want.cell_type != "code":
            continue
        err = text_outputs(got, "stderr")
        assert not [t for t in _TROUBLE if t in err], f"{path.name} cell {i} stderr:\n{err}"
        assert not machine_details(text_outputs(want) + text_outputs(want, "stderr"))
        assert _images(want) <= _images(got), f"{path.name} cell {i} drew no figure"
        if "varies" in want.metadata.get("tags", []):
            continue
        expected = text_outputs(want)
        problems = differences(expected, text_outputs(got))
        assert not problems, f"{path.name} cell {i}:\n" + "\n".join(problems)
        checked += bool(expected)
    assert checked >= 3  # the committed notebook has outputs to compare


def _images(cell: dict) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def test_the_tutorials_draw_what_they_teach() -> None:
    """The loss curves of one process against two ranks (02, 03), the mesh (04), the operators
    and the experts' load (05) are in the committed outputs."""
    import nbformat

    drawn = {p.stem[:2]: sum(_images(c) for c in nbformat.read(p, as_version=4).cells)
             for p in NOTEBOOKS}  # fmt: skip
    assert drawn["02"] >= 1 and drawn["03"] >= 1 and drawn["04"] >= 1 and drawn["05"] >= 3


def test_there_are_tutorials() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01_collectives.ipynb", "02_data_parallel.ipynb", "03_zero_and_checkpoints.ipynb",
        "04_meshes_and_tensor_parallel.ipynb", "05_tensor_and_expert_parallel.ipynb",
    ]  # fmt: skip


def test_output_comparison() -> None:
    assert differences("loss 0.5012\n[rank 1] 10.0", "loss 0.5030\n[rank 1] 10.0") == []
    wrong = differences("[rank 0] 10.0", "[rank 0] 3.0")
    assert wrong == ["3.0 where the committed output has 10.0"]
    assert differences("[3. 3.]", "[3. 3. 3.]")  # another shape: the text differs
    assert differences("identical: True", "identical: False")
    assert differences("step 100", "step 101")  # integers exactly
    assert differences("step 2", "step 2.0")  # an integer is not a float
    assert differences("float32[128]", "float32[129]")
    assert differences("5e-7", "-5e-7")
    assert differences("[54. 72. 90.]", "[54.000004 72. 90.]") == []  # numpy's padding

    # JAX's ops in an op list are not compared, spmd's are (value numbers aside)
    def trace(op: str, jax_op: str = "mul") -> str:
        return (
            f"[rank 0] def @f(%x: T) {{\n[rank 0]   let %x_1 = {jax_op}(%x, %x);\n{op}\n"
            "[rank 0]   %x_2\n[rank 0] }"
        )

    ours = "[rank 0]   let %x_2 = spmd.allreduce(%x_1) /* op=sum */;"
    assert differences(trace(ours), trace(ours, jax_op="pow")) == []
    assert differences(trace(ours), trace(ours.replace("_2", "_7").replace("_1", "_5"))) == []
    assert differences(trace(ours), trace(ours.replace("sum", "max")))
    assert differences(trace(ours), trace(""))
    # outside an op list, lines starting with "(" or "%" are compared like any other
    assert differences("(7, 4) split: rows 6..6", "(8, 4) split: rows 6..6")
    assert differences("rows 0..127 here", "rows 0..128 here")  # a range: integers
    assert differences("[10. 20.]", "[ 9.999999 20. ]") == []


def test_machine_details_are_found() -> None:
    assert machine_details("written to /home/someone/ckpt") == ["/home/someone/ckpt"]
    assert machine_details("rank 1/2, 3/4 done; 1e-5/N") == []


def refresh(paths: list[Path]) -> None:
    """Executes each notebook and writes it back with its new outputs (standard error and the
    Python version left out: they belong to the machine that ran it)."""
    import nbformat

    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            notebook = execute(path, Path(tmp))
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.outputs = [
                    o
                    for o in cell.outputs
                    if not (o.output_type == "stream" and o.name == "stderr")
                ]
        notebook.metadata.get("language_info", {}).pop("version", None)
        nbformat.write(notebook, path)
        print(f"refreshed {path.relative_to(ROOT)}")


if __name__ == "__main__":
    refresh([Path(p).resolve() for p in sys.argv[1:]] or NOTEBOOKS)
