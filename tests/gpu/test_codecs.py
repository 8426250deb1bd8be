"""The quantized all-reduce's block-scaled codecs (native/cuda/codec.h), run on the CPU: the same
source the GPU kernel compiles. Checked against ml_dtypes' float8_e4m3fn, against the error bounds
docs/gpu.md states, and against the exact sum."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from spmd._native_lib import native
from spmd.ops._gpu_chain import CODECS

QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
BLOCK = 32


def roundtrip(codec: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    return np.frombuffer(native().quant_roundtrip(CODECS[codec], x.tobytes()), np.float32)


def reference(codec: str, xs: np.ndarray) -> np.ndarray:
    xs = np.ascontiguousarray(xs, np.float32)
    out = native().quant_allreduce_reference(CODECS[codec], xs.shape[0], xs.tobytes())
    return np.frombuffer(out, np.float32)


def block_amax(x: np.ndarray) -> np.ndarray:
    """Each value's block's largest magnitude."""
    pad = -len(x) % BLOCK
    blocks = np.abs(np.concatenate([x, np.zeros(pad, x.dtype)])).reshape(-1, BLOCK)
    return np.repeat(blocks.max(axis=1), BLOCK)[: len(x)]


def bound(codec: str, x: np.ndarray) -> np.ndarray:
    """docs/gpu.md's bound of one encode/decode, plus a few ulp of the block's scale."""
    amax = block_amax(x).astype(np.float64)
    slack = 4 * np.finfo(np.float32).eps * amax
    if codec == "fp8":
        return np.abs(x) / 16 + amax / (448 * 1024) + slack
    return amax / (2 * QMAX[codec]) + slack


def data(rng: np.random.Generator, n: int) -> np.ndarray:
    """Blocks of very different scales, an all-zero block and a constant one."""
    x = rng.standard_normal(n).astype(np.float32)
    x *= np.repeat(10.0 ** rng.uniform(-6, 6, -(-n // BLOCK)), BLOCK)[:n].astype(np.float32)
    if n >= 3 * BLOCK:
        x[BLOCK : 2 * BLOCK] = 0
        x[2 * BLOCK : 3 * BLOCK] = -3.5
    return x


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 4099])
def test_roundtrip_within_the_documented_bound(codec, n):
    x = data(np.random.default_rng(n), n)
    y = roundtrip(codec, x)
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= bound(codec, x)), (err - bound(codec, x)).max()
    # zeros stay zeros, and a block's largest value survives (up to the scale's rounding)
    assert np.all(y[x == 0] == 0)
    big = np.abs(x) == block_amax(x)
    np.testing.assert_allclose(y[big], x[big], rtol=1e-6)


@pytest.mark.parametrize("codec", list(CODECS))
def test_roundtrip_is_not_the_identity(codec):
    """The codec really drops bits: a smooth ramp does not come back exactly."""
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    assert not np.array_equal(roundtrip(codec, x), x)


def test_fp8_matches_ml_dtypes_e4m3():
    """With a block whose largest magnitude is 448 the scale is 1, so each value goes through
    E4M3 alone: the encoder must round exactly as ml_dtypes' float8_e4m3fn (nearest, ties to
    even), subnormals included."""
    rng = np.random.default_rng(0)
    mags = np.concatenate([
        rng.uniform(0, 448, 3000), rng.uniform(0, 2**-6, 1000), 2.0 ** np.arange(-10, 9),
        np.float32(ml_dtypes.float8_e4m3fn(1.0)) * (1 + np.arange(8) / 16),  # ties
    ]).astype(np.float32)  # fmt: skip
    values = mags * rng.choice([-1, 1], len(mags)).astype(np.float32)
    pad = -len(values) % (BLOCK - 1)
    values = np.concatenate([values, np.zeros(pad, np.float32)]).reshape(-1, BLOCK - 1)
    blocks = np.concatenate([np.full((len(values), 1), 448, np.float32), values], axis=1).ravel()
    got = roundtrip("fp8", blocks)
    want = blocks.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_int_codecs_round_to_the_nearest_step():
    x = np.array([7.0, 3.5, 2.5, -2.5, 1.4, -0.5] + [0.0] * 26, np.float32)  # scale 1 for int4
    np.testing.assert_array_equal(roundtrip("int4", x)[:6], [7, 4, 2, -2, 1, -0])
    x = np.array([127.0, 0.5, 1.5, -126.5] + [0.0] * 28, np.float32)  # scale 1 for int8
    np.testing.assert_array_equal(roundtrip("int8", x)[:4], [127, 0, 2, -126])


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_quantized_allreduce_reference(codec, world):
    """What every rank gets: dec(enc(sum_r dec(enc(x_r)))), the sum in rank order in float32;
    within the bound of each rank's encoding plus the encoding of the sum."""
    rng = np.random.default_rng(world)
    n = 32 * 37 + 5
    xs = np.stack([rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(world)])
    got = reference(codec, xs)
    decoded = np.zeros(n, np.float32)
    for r in range(world):
        decoded = decoded + roundtrip(codec, xs[r])  # float32, rank order
    np.testing.assert_array_equal(got, roundtrip(codec, decoded))
    exact = xs.astype(np.float64).sum(axis=0)
    allowed = sum(bound(codec, xs[r]) for r in range(world)) + bound(codec, decoded)
    err = np.abs(got - exact)
    assert np.all(err <= allowed + 1e-6 * np.abs(exact)), (err - allowed).max()
    # relative to the data: int8 and fp8 keep a few digits, int4 about one
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < {"fp8": 0.08, "int8": 0.02, "int4": 0.25}[codec], rel


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_block_with_a_nan_or_an_infinity_decodes_as_nan(codec):
    """NaN and infinities must survive quantisation (a loss-scaling overflow check looks for
    them after the all-reduce): the whole block decodes as NaN, the other blocks as usual."""
    for bad in (np.nan, np.inf, -np.inf):
        x = np.linspace(-1, 1, 3 * BLOCK, dtype=np.float32)
        x[BLOCK + 5] = bad
        y = roundtrip(codec, x)
        assert np.all(np.isnan(y[BLOCK : 2 * BLOCK])), (bad, y[BLOCK : 2 * BLOCK])
        rest = np.r_[0:BLOCK, 2 * BLOCK : 3 * BLOCK]
        assert np.all(np.abs(y[rest] - x[rest]) <= bound(codec, x)[rest])
    xs = np.ones((2, BLOCK), np.float32)
    xs[0, 3] = np.nan
    assert np.all(np.isnan(reference(codec, xs)))


@pytest.mark.parametrize("codec", list(CODECS))
def test_tiny_blocks_neither_overflow_nor_lose_the_bound(codec):
    """amax below 2^-100 decodes as zeros (qmax / amax would overflow near 1e-36); above it the
    usual bound holds, down to amax = 2^-100 where the scale is still a normal float."""
    flush = 2.0**-100
    for amax in (1e-38, 1e-36, 3e-36, 0.99 * flush):
        x = np.zeros(BLOCK, np.float32)
        x[0], x[1], x[7] = amax, -amax / 4, amax / 3
        y = roundtrip(codec, x)
        np.testing.assert_array_equal(y, np.zeros(BLOCK, np.float32), err_msg=f"amax {amax}")
    for amax in (flush, 1e-30, 1e-20):
        x = (np.linspace(-1, 1, BLOCK) * amax).astype(np.float32)
        y = roundtrip(codec, x)
        err = np.abs(y.astype(np.float64) - x)
        assert np.all(err <= bound(codec, x)), (amax, (err - bound(codec, x)).max())


def test_bad_codec_code_is_an_error():
    with pytest.raises(ValueError, match="codec code"):
        native().quant_roundtrip(7, np.zeros(4, np.float32).tobytes())
