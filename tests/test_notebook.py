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
    assert '[rank 1]   File "<string>", line 4, in <module>' in err
    assert "[rank 1] [rank 1]" not in err  # the wrapper's prefix is not doubled
    assert err.rstrip().endswith("spmd-run: rank 1 failed: KeyError: 'lost'")
    assert CellFailed("x")._render_traceback_() == ["CellFailed: x"]


def test_timeout_stops_the_job(capsys):
    with pytest.raises(CellFailed, match="exit code 124"):
        run_cell("-n 2 --timeout 3", "import time\ntime.sleep(60)\n")
    assert "timed out after 3 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "the following arguments are required: -n"),
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
