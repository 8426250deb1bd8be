"""examples/train_lm.py on a 3D mesh (its own file: the suite's longest test, which the
scheduler starts first; see tests/DURATIONS.md)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from .test_examples import _run


def _steps(out: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in re.findall(r"^step (\d+) loss ([\d.]+)$", out, re.M)}


@pytest.mark.slow(reason="six jobs of train_lm.py, one of 8 ranks on a 2-core machine")
def test_train_lm_3d_follows_one_process_and_resumes_on_other_layouts(tmp_path):
    """Mesh(pp=2, dp=2, tp=2) on 8 ranks follows the one-process run; its checkpoint resumes on
    4 ranks with pp=1 and in one process, which continue as the one-process run does; ZeRO-2
    with GPipe on Mesh(pp=2, cp=2) (ring attention over cp, ZeRO over dp and cp) follows it
    too."""
    pytest.importorskip("matplotlib")
    check = ("--check", "--sample", "0")
    one = _steps(_run(1, "train_lm.py", "--steps", "5", *check, cwd=tmp_path))
    assert len(one) == 5 and one[5] < one[1], one
    out = _run(8, "train_lm.py", "--mesh", "pp=2,dp=2,tp=2", "--steps", "3", "--save", "ck",
               "--plot", "curve.png", "--check", "--sample", "40", cwd=tmp_path)  # fmt: skip
    eight = _steps(out)
    assert sorted(eight) == [1, 2, 3], out
    np.testing.assert_allclose([eight[i] for i in (1, 2, 3)], [one[i] for i in (1, 2, 3)],
                               rtol=1e-5)  # fmt: skip
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert re.search(r"^sample:\ndef ", out, re.M), out
    for nprocs, mesh in ((4, "dp=2,tp=2"), (1, "")):
        resumed = _steps(_run(nprocs, "train_lm.py", "--mesh", mesh, "--steps", "5",
                              "--resume", "ck", *check, cwd=tmp_path))  # fmt: skip
        assert sorted(resumed) == [4, 5], (mesh, resumed)
        np.testing.assert_allclose([resumed[4], resumed[5]], [one[4], one[5]], rtol=1e-5)
    zero = _steps(_run(4, "train_lm.py", "--mesh", "pp=2,cp=2", "--zero", "2", "--schedule",
                       "gpipe", "--steps", "3", *check, cwd=tmp_path))  # fmt: skip
    np.testing.assert_allclose([zero[i] for i in (1, 2, 3)], [one[i] for i in (1, 2, 3)],
                               rtol=1e-5)  # fmt: skip
