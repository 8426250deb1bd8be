"""Elastic restart under the real launcher: ``spmd-run --max-restarts`` starts a job again after
a rank is SIGKILLed, and spmd.elastic resumes it from its newest checkpoint, at the same world
size (the parameters equal an uninterrupted run's, bit for bit) or a smaller one (equal to
rounding); what a restart says, and when it does not happen."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from .. import _leftovers as leftovers
from .test_run import _left_behind, _mpich_files, spmd_run

TRAIN = str(Path(__file__).with_name("_elastic_train.py"))


def _train(tmp_path, name, *options, kill_at=-1, always=False, n=2):
    out = tmp_path / f"{name}.npz"
    args = [*options, "-n", str(n), sys.executable, TRAIN, str(tmp_path / name), str(out),
            str(kill_at), *(["always"] if always else [])]  # fmt: skip
    run, _ = spmd_run(*args, timeout=180)
    return run, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's parameters (2 ranks, 12 steps)."""
    tmp = tmp_path_factory.mktemp("elastic")
    run, out = _train(tmp, "ref")
    assert run.returncode == 0, run.stderr
    return dict(np.load(out))


def test_a_killed_rank_restarts_the_job_which_resumes_where_it_checkpointed(tmp_path, reference):
    before, segments = _mpich_files(), leftovers.files(["/dev/shm/spmd-*"])
    run, out = _train(tmp_path, "ckpt", "--max-restarts", "1", kill_at=7)
    assert run.returncode == 0, run.stderr
    assert "spmd-run: rank 1 failed: killed by SIGKILL" in run.stderr
    assert "restarting the job on 2 ranks (restart 1 of 1, after exit code 137)" in run.stderr
    assert re.search(r"restart 1: resumed from \S+step-00000006 \(step 6\) on 2 ranks", run.stderr)
    killed = float(re.search(r"killed at ([\d.]+)", run.stdout).group(1))
    resumed = float(re.search(r"resumed at step 6 on 2 ranks at ([\d.]+)", run.stdout).group(1))
    assert resumed > killed
    got = np.load(out)
    for k in ("w", "b"):
        np.testing.assert_array_equal(got[k], reference[k])  # the same run, bit for bit
    # keep=2: the two newest checkpoints remain, no temporary directories
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000009", "step-00000012"
    ]  # fmt: skip
    assert _left_behind(before) == set(), "MPICH's files were left behind"
    assert leftovers.new_files(["/dev/shm/spmd-*"], segments) == set(), (
        "a group segment was left behind"
    )


def test_a_restart_on_fewer_ranks_reshards_the_checkpoint(tmp_path, reference):
    run, out = _train(tmp_path, "ckpt", "--max-restarts", "1", "--ranks-after-failure", "1",
                      kill_at=4)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "restarting the job on 1 ranks (restart 1 of 1" in run.stderr
    assert "(step 3) on 1 ranks" in run.stderr
    got = np.load(out)
    for k in ("w", "b"):  # the same global batches: the same arithmetic, grouped otherwise
        np.testing.assert_allclose(got[k], reference[k], rtol=1e-5, atol=1e-6)


def test_a_restart_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, reference):
    run, out = _train(tmp_path, "ckpt", "--max-restarts", "1", kill_at=1)
    assert run.returncode == 0, run.stderr
    assert "restart 1: no checkpoint in" in run.stderr and "starting fresh" in run.stderr
    np.testing.assert_array_equal(np.load(out)["w"], reference["w"])


def test_restarts_end_when_used_up_and_not_after_a_stop_asked_for(tmp_path):
    run, _ = _train(tmp_path, "ckpt", "--max-restarts", "2", kill_at=4, always=True)
    assert run.returncode == 137, run.stderr
    assert run.stderr.count("spmd-run: restarting the job") == 2
    assert "restart 2 of 2" in run.stderr
    script = tmp_path / "sleep.py"
    script.write_text("import time, spmd\nspmd.init()\ntime.sleep(60)\n")
    run, _ = spmd_run("--max-restarts", "3", "--timeout", "3", "-n", "2", sys.executable,
                      str(script))  # fmt: skip
    assert run.returncode == 124 and "restarting" not in run.stderr, run.stderr
    run, _ = spmd_run("--max-restarts", "-1", "-n", "1", sys.executable, str(script))
    assert run.returncode == 2 and "--max-restarts -1: need 0 or more" in run.stderr
