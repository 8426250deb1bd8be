"""The examples run as the README says, under the real launcher, and do what they claim."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
SPMD_RUN = [sys.executable, "-m", "spmd.cli.run"]


def _run(nprocs: int, script: str, *args: str, cwd: pathlib.Path) -> str:
    out = subprocess.run(
        [*SPMD_RUN, "-n", str(nprocs), sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("zero", [0, 3])
def test_train_digits_reaches_95_percent_and_writes_a_checkpoint(tmp_path, zero):
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    import spmd

    out = _run(2, "train_digits.py", "--checkpoint", "ck/digits", "--zero", str(zero),
               cwd=tmp_path)  # fmt: skip
    losses = [float(m) for m in re.findall(r"epoch +\d+ +loss ([\d.]+)", out)]
    assert len(losses) == 12 and losses[-1] < losses[0] / 5, out
    accuracy = float(re.search(r"test accuracy ([\d.]+)", out).group(1))
    assert accuracy >= 0.95, out
    # written by 2 ranks (sharded at stage 3), read here by one process
    ck = spmd.load(tmp_path / "ck" / "digits")
    assert ck["params"][0]["w"].shape == (64, 128)
    assert ck["params"][1]["b"].shape == (10,)
    assert ck["opt_state"][0].mu[0]["w"].shape == (64, 128)
    assert spmd.checkpoint.metadata(tmp_path / "ck" / "digits")["sampler"]["num_replicas"] == 2


def test_train_digits_elastic_goes_on_from_its_newest_checkpoint(tmp_path):
    """--elastic DIR: a second run (as a restarted job would) starts after the last epoch the
    first one saved, on another world size."""
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    common = ("--elastic", "el", "--checkpoint", "ck/digits")
    first = _run(2, "train_digits.py", "--epochs", "2", *common, cwd=tmp_path)
    assert re.findall(r"epoch +(\d+) +loss", first) == ["1", "2"], first
    assert sorted(p.name for p in (tmp_path / "el").iterdir()) == [
        "step-00000001", "step-00000002"
    ]  # fmt: skip
    second = _run(1, "train_digits.py", "--epochs", "3", *common, cwd=tmp_path)
    assert re.findall(r"epoch +(\d+) +loss", second) == ["3"], second


def test_hello(tmp_path):
    out = _run(2, "hello.py", cwd=tmp_path)
    assert "rank 0 of 2" in out and "rank 1 of 2" in out


def test_equinox_mlp_fits_the_curve(tmp_path):
    pytest.importorskip("equinox")
    out = _run(2, "equinox_mlp.py", cwd=tmp_path)
    error = float(re.search(r"on \[-1, 1\]: ([\d.]+)", out).group(1))
    assert error < 0.15, out


def _epochs(out: str) -> tuple[list[float], float]:
    losses = [float(m) for m in re.findall(r"epoch \d+  loss ([\d.]+)", out)]
    return losses, float(re.search(r"test accuracy ([\d.]+)", out).group(1))


def test_flax_nnx_cnn_in_place_step_follows_one_process(tmp_path):
    """Flax's tutorial step as written (objects updated in place, nothing returned): 2 ranks
    follow one process epoch for epoch and reach its accuracy."""
    pytest.importorskip("flax")
    pytest.importorskip("sklearn")
    two, two_accuracy = _epochs(_run(2, "flax_nnx_cnn.py", cwd=tmp_path))
    one, one_accuracy = _epochs(_run(1, "flax_nnx_cnn.py", cwd=tmp_path))
    assert len(two) == len(one) == 4 and one[-1] < one[0] / 4, (two, one)
    np.testing.assert_allclose(two, one, rtol=1e-3)
    assert one_accuracy >= 0.9 and abs(two_accuracy - one_accuracy) <= 0.01


def test_haiku_mlp_learns_as_one_process_does(tmp_path):
    """Haiku's transform_with_state with batch norm: per-rank batch statistics make the runs
    differ a little, so the check is the learning itself, against one process."""
    pytest.importorskip("haiku")
    pytest.importorskip("sklearn")
    two, two_accuracy = _epochs(_run(2, "haiku_mlp.py", cwd=tmp_path))
    one, one_accuracy = _epochs(_run(1, "haiku_mlp.py", cwd=tmp_path))
    assert len(two) == len(one) == 4 and two[-1] < two[0] / 4, (two, one)
    np.testing.assert_allclose(two, one, rtol=0.2)
    assert min(one_accuracy, two_accuracy) >= 0.93, (one_accuracy, two_accuracy)


def _losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"step +\d+ +loss ([\d.]+)", out)]


@pytest.mark.slow(reason="a 4-rank and a one-process training run")
def test_train_moe_on_a_dp_tp_mesh_follows_one_process(tmp_path):
    """Mesh(dp=2, tp=2): the tensor-parallel block and the experts split over dp follow the
    one-process run on the same global batches step for step."""
    pytest.importorskip("sklearn")
    args = ("--steps", "5", "--aux-weight", "0", "--print-every", "1")
    four = _losses(_run(4, "train_moe.py", "--mesh", "dp=2,tp=2", *args, cwd=tmp_path))
    one = _losses(_run(1, "train_moe.py", *args, cwd=tmp_path))
    assert len(four) == len(one) == 5
    np.testing.assert_allclose(four, one, rtol=1e-4)
    assert one[-1] < one[0]


@pytest.mark.slow(reason="60 steps on 4 ranks and in one process")
def test_train_moe_on_a_dp_ep_mesh_learns_as_one_process_does(tmp_path):
    """Mesh(dp=2, ep=2) with the load-balancing loss (computed per rank, so the runs differ by
    rounding and by the loss's grouping): the same loss after 60 steps, and the digits learnt."""
    pytest.importorskip("sklearn")
    args = ("--steps", "60")
    out = _run(4, "train_moe.py", "--mesh", "dp=2,ep=2", *args, cwd=tmp_path)
    one_out = _run(1, "train_moe.py", *args, cwd=tmp_path)
    four, one = _losses(out), _losses(one_out)
    assert four[-1] < four[0] / 3, out
    np.testing.assert_allclose(np.mean(four[-3:]), np.mean(one[-3:]), rtol=0.05)
    accuracy = float(re.search(r"test accuracy ([\d.]+)", out).group(1))
    assert accuracy >= 0.7, out
    load = re.search(r"expert load .*: \[([\d, ]+)\]", out).group(1)
    assert all(int(c) > 0 for c in load.split(",")), out  # every expert is used
