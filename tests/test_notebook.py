"""The ``%%spmd`` cell magic (spmd.notebook): each rank's output in rank order, failures raised,
usage errors. The tutorials' test runs the magic in a real kernel."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

from spmd import SpmdError
from spmd.notebook import CellFailed, run_cell

CELL = """
import sys
import jax.numpy as jnp
import spmd
comm = spmd.init()
print("sum", spmd.allreduce(jnp.float32(comm.rank + 1)))
print("rank", comm.rank, "of", comm.size)
print("note from", comm.rank, file=sys.stderr)
print(chr(13).join(["10%", "50%", "100%"]))  # a progress bar redrawn in place
print("crlf", end=chr(13) + chr(10))
"""


def test_each_ranks_output_in_rank_order(capsys):
    assert run_cell("-n 3", CELL) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"[rank {r}] {line}"
        for r in range(3)
        for line in ("sum 6.0", f"rank {r} of 3", "100%", "crlf")
    ]
    assert err.splitlines() == [f"[rank {r}] note from {r}" for r in range(3)]


def test_rank_0s_output_arrives_while_the_job_runs(monkeypatch):
    """Rank 0's lines are shown as it prints them (its print is not flushed: the ranks run
    unbuffered), long before the job ends; the other ranks' when it ends, in rank order."""
    import io
    import time

    seen = []

    class Clock(io.StringIO):
        def write(self, text):
            seen.append((time.monotonic(), text))
            return super().write(text)

    monkeypatch.setattr("sys.stdout", Clock())
    cell = (
        "import time, spmd\n"
        "comm = spmd.init()\n"
        "print('early', comm.rank)\n"
        "time.sleep(4)\n"
        "print('late', comm.rank)\n"
    )
    assert run_cell("-n 2", cell) == 0
    done = time.monotonic()
    lines = [(t, text) for t, text in seen if text.startswith("[rank")]
    assert [text for _, text in lines] == [
        "[rank 0] early 0", "[rank 0] late 0", "[rank 1] early 1", "[rank 1] late 1"
    ]  # fmt: skip
    assert done - lines[0][0] >= 3.0  # "early" was shown before the 4 s sleep ended


def test_a_failing_rank_raises_with_its_traceback_shown(capsys):
    cell = (
        "import spmd\n"
        "comm = spmd.init()\n"
        "if comm.rank == 1:\n"
        "    raise KeyError('lost')\n"
        "comm.barrier()\n"
    )
    with pytest.raises(CellFailed, match="on 2 ranks ended with exit code 1"):
        run_cell("-n 2 --timeout 60", cell)
    err = capsys.readouterr().err
    assert '[rank 1]   File "<cell>", line 4, in <module>' in err
    assert '"<string>"' not in err  # the frame that runs the cell is not the user's
    assert "[rank 1]     raise KeyError('lost')" in err  # the line's source is shown
    assert "[rank 1] [rank 1]" not in err  # the wrapper's prefix is not doubled
    assert "spmd-run: rank 1 failed: KeyError: 'lost'" in err
    # rank 0, waiting in an MPI barrier, is stopped by spmd-run after the grace period
    assert err.rstrip().endswith("spmd-run: stopped ranks [0] after rank 1 failed"), err
    assert CellFailed("x")._render_traceback_() == ["CellFailed: x"]


def test_a_rank_that_writes_nothing_shows_no_line(capsys):
    run_cell("-n 2", "import spmd\nif spmd.init().rank == 1:\n    print('only 1')\n")
    assert capsys.readouterr() == ("[rank 1] only 1\n", "")


def test_timeout_stops_the_job(capsys):
    with pytest.raises(CellFailed, match="exit code 124"):
        run_cell("-n 2 --timeout 3", "import time\ntime.sleep(60)\n")
    assert "timed out after 3 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "no pool runs: start one with %spmd start -n N"),  # without -n: the pool's
        ("--out x", "no pool runs"),
        ("-n 2 --out x", "--out takes values from the ranks of a pool"),
        ("-n two", "invalid int value: 'two'"),
        ("-n 2 --gpus 1", "unrecognized arguments: --gpus 1"),
        ("-n 0", "-n 0: need at least one rank"),
    ],
)
def test_usage_errors(line, message):
    with pytest.raises(SpmdError, match=message):
        run_cell(line, "pass")


def test_the_extension_registers_the_cell_magic(capsys):
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "spmd.notebook")
        shell.run_cell_magic("spmd", "-n 2", "import spmd\nprint(spmd.init().size)")
    finally:
        InteractiveShell.clear_instance()
    assert capsys.readouterr().out == "[rank 0] 2\n[rank 1] 2\n"


def test_the_cell_runs_as_a_main_program_beside_the_notebooks_modules(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    cell = (
        "import pickle\n"
        "import helpers\n"  # the kernel's working directory is on the path, as with -c
        "class Point:\n"
        "    pass\n"
        "p = pickle.loads(pickle.dumps(Point()))\n"  # classes defined in the cell pickle
        "print(__name__, helpers.double(21), type(p).__name__, sorted(k for k in globals() "
        "if k.startswith('_') and not k.startswith('__')))\n"
        + "# a long cell: more than one command-line argument may hold (128 KiB)\n"
        * 3000
    )
    run_cell("-n 2", cell)
    out = capsys.readouterr().out
    assert out.splitlines() == [f"[rank {r}] __main__ 42 Point []" for r in range(2)]


def test_push_sends_notebook_variables_to_every_rank(capsys):
    import jax.numpy as jnp
    import numpy as np

    namespace = {
        "lr": 0.125,
        "sizes": [784, 32, 10],
        "table": {"a": np.arange(6, dtype=np.int16).reshape(2, 3)},
        "w": jnp.full((2, 2), 1.5, jnp.bfloat16),
        "other": "not pushed",
    }
    cell = (
        "import spmd\n"
        "comm = spmd.init()\n"
        "print(lr * (comm.rank + 1), sizes, table['a'].dtype, table['a'].sum(), "
        "type(w).__module__, w.dtype, float(w.sum()), 'other' in globals())\n"
    )
    run_cell("-n 2 --push lr sizes,table w", cell, namespace)
    out = capsys.readouterr().out.splitlines()
    # a JAX array arrives as a NumPy array (JAX starts on the rank with spmd.init)
    assert out == [
        f"[rank {r}] {0.125 * (r + 1)} [784, 32, 10] int16 15 numpy bfloat16 6.0 False"
        for r in range(2)
    ]


def _notebook_function(x):
    return x


class _NotebookClass:
    pass


@pytest.mark.parametrize(
    "value, message",
    [
        (
            _notebook_function,
            "--push v: the function _notebook_function is defined in the notebook",
        ),
        ([1, _NotebookClass], "--push v: the class _NotebookClass is defined in the notebook"),
        ({"model": _NotebookClass()}, "--push v: the class _NotebookClass is defined in the"),
        ((i for i in range(3)), "--push v: a generator cannot be pickled"),
    ],
)
def test_push_refuses_what_the_ranks_cannot_load(value, message, monkeypatch):
    # what a notebook defines lives in the kernel's __main__
    monkeypatch.setattr(_notebook_function, "__module__", "__main__")
    monkeypatch.setattr(_NotebookClass, "__module__", "__main__")
    with pytest.raises(SpmdError, match=message):
        run_cell("-n 2 --push v", "pass", {"v": value})


def test_push_names_a_missing_variable():
    with pytest.raises(SpmdError, match="no variable named b, c in the notebook"):
        run_cell("-n 2 --push a,b,c", "pass", {"a": 1})


def test_a_pool_keeps_its_ranks_and_their_variables_across_cells_in_a_kernel(tmp_path):
    """%spmd start -n 2 in a real kernel: cells run on the same ranks, whose variables last;
    --out brings one value per rank back; a cell that raises shows the traceback and leaves the
    pool running; %spmd stop stops it, after which a pool cell says there is none."""
    import nbformat

    from .test_tutorials import execute, text_outputs

    cells = [
        "%load_ext spmd.notebook",
        "%spmd start -n 2",
        "%%spmd\nimport os, spmd\nimport jax.numpy as jnp\ncomm = spmd.init()\n"
        "x = comm.rank * 10\npid = os.getpid()\nprint('hello from', comm.rank)",
        "%%spmd --out x total pid\nx += 1\ntotal = spmd.allreduce(jnp.float32(x))",
        "print(x, [float(t) for t in total], len(set(pid)))",
        "%%spmd\nif comm.rank == 1:\n    raise KeyError('lost')",
        "%%spmd --out pid2\npid2 = os.getpid()",
        "print(pid2 == pid)",
        "%spmd stop",
        "%%spmd\nx",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    path = tmp_path / "pool.ipynb"
    nbformat.write(nb, path)
    work = tmp_path / "work"
    work.mkdir()
    ran = _execute_allowing_errors(execute, path, work)
    out = [text_outputs(c) for c in ran.cells]
    err = [text_outputs(c, "stderr") for c in ran.cells]
    assert "started 2 ranks" in out[1]
    assert out[2].splitlines() == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert out[4].strip() == "[1, 11] [12.0, 12.0] 2"  # two processes, values from both
    assert "KeyError: 'lost'" in err[5] and "[rank 1]" in err[5]
    assert _error(ran.cells[5]) == "CellFailed"  # the cell fails; the pool stays
    assert out[7].strip() == "True"  # the same processes as before the failing cell
    assert _error(ran.cells[9]) == "SpmdError" and "no pool runs" in str(ran.cells[9].outputs)


def _execute_allowing_errors(execute, path, work):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata["tags"] = ["raises-exception"]  # nbclient goes on past a failing cell
    nbformat.write(nb, path)
    return execute(path, work)


def _error(cell) -> str:
    return next((o["ename"] for o in cell.outputs if o["output_type"] == "error"), "")


def test_a_pool_rank_that_dies_is_reported_and_the_pool_starts_again(capsys):
    from spmd.notebook import start_pool, stop_pool

    try:
        start_pool(2)
        run_cell("", "import os, spmd\ncomm = spmd.init()")
        with pytest.raises(CellFailed, match="the pool was stopped"):
            run_cell("", "if comm.rank == 1:\n    os._exit(3)\nspmd.barrier()")
        assert "rank 1 died" in capsys.readouterr().err  # (MPICH then ends rank 0 too)
        with pytest.raises(SpmdError, match="the pool's ranks are gone"):
            run_cell("", "pass")
        start_pool(2)
        run_cell("", "import spmd\nprint(spmd.init().size)")
        assert capsys.readouterr().out.endswith("[rank 0] 2\n[rank 1] 2\n")
    finally:
        stop_pool()
