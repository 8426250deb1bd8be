"""Checkpoints other programs read: a tree with ShardedArrays saved on 4 ranks as an Orbax
checkpoint restores with orbax.checkpoint in one plain process with identical values, and an
Orbax checkpoint written by a one-process program loads into a sharded layout at 2 and 3 ranks;
a safetensors file written on 4 ranks (names joined by dots, full tensors) reads with the
safetensors package alone, and loads back into another layout at another world size; missing
or extra tensors and wrong shapes are errors on every rank."""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import run

P = spmd.PartitionSpec
ocp = pytest.importorskip("orbax.checkpoint")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _full():
    """The global arrays: uneven splits (10 rows over 4 ranks, 4 over 3), int leaves included."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            "dense": {"w": rng.standard_normal((10, 6)).astype(np.float32),
                      "b": rng.standard_normal(6).astype(np.float32)},
            "layers": [rng.standard_normal((4, 8)).astype(np.float32),
                       np.arange(12, dtype=np.int32).reshape(3, 4)],
        },
        "step": np.int64(7),
    }  # fmt: skip


ROWS, COLUMNS = P("x", None), P(None, "x")


def _sharded(full, spec_w=ROWS, spec_l=COLUMNS):
    with spmd.Mesh(x=spmd.get_communicator().size) as mesh:
        p = full["params"]
        return {
            "params": {
                "dense": {"w": spmd.shard(jnp.asarray(p["dense"]["w"]), spec_w, mesh),
                          "b": jnp.asarray(p["dense"]["b"])},
                "layers": [spmd.shard(jnp.asarray(p["layers"][0]), spec_l, mesh),
                           jnp.asarray(p["layers"][1])],
            },
            "step": full["step"],
        }  # fmt: skip


def _blocks(tree):
    return [
        (np.asarray(x.local), tuple(s.start for s in x.index())) if spmd.sharded.is_sharded(x)
        else np.asarray(x)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=spmd.sharded.is_sharded)
    ]  # fmt: skip


def save_orbax_from_ranks(path):
    spmd.save(path, _sharded(_full()), format="orbax")
    return sorted(p.name for p in __import__("pathlib").Path(path).iterdir())


def load_into_layout(path, fmt):
    like = _sharded(_full(), spec_w=COLUMNS, spec_l=ROWS)
    if fmt == "orbax":
        got = spmd.load(path, like=like)
    else:
        got = spmd.checkpoint.load_safetensors(path, like)
    return _blocks(got), _blocks(like)


def test_orbax_checkpoint_from_4_ranks_restores_in_one_plain_process_and_back(tmp_path):
    path = str(tmp_path / "orbax")
    files = run(save_orbax_from_ranks, 4, args=(path,))
    assert files[0] == files[3] and "_CHECKPOINT_METADATA" in files[0], files
    # One process, Orbax alone.
    restored = ocp.StandardCheckpointer().restore(path)
    want = _full()
    got_leaves = jax.tree_util.tree_leaves(restored)
    want_leaves = jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), w)
    plain_load = spmd.load(path)  # no like: Orbax's own restore, through spmd
    for g, w in zip(jax.tree_util.tree_leaves(plain_load), want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)

    # Back: a one-process program's Orbax checkpoint into a sharded layout at 2 and 3 ranks.
    plain = str(tmp_path / "plain")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(plain, jax.tree_util.tree_map(jnp.asarray, want))
    for n in (2, 3):
        for got, like in run(load_into_layout, n, args=(plain, "orbax")):
            _assert_blocks(got, like)


def _assert_blocks(got, like):
    """The blocks read equal the blocks of the same layout cut from the full arrays."""
    assert len(got) == len(like)
    for g, w in zip(got, like, strict=True):
        if isinstance(w, tuple):
            assert g[1] == w[1]
            np.testing.assert_array_equal(g[0], w[0])
        else:
            np.testing.assert_array_equal(g, w)


def save_safetensors_from_ranks(path):
    spmd.checkpoint.save_safetensors(path, _sharded(_full()))


def test_safetensors_from_4_ranks_reads_with_the_package_alone_and_loads_in_another_layout(
    tmp_path,
):
    path = str(tmp_path / "model.safetensors")
    run(save_safetensors_from_ranks, 4, args=(path,))
    got = safetensors_numpy.load_file(path)
    want = _full()
    assert sorted(got) == [
        "params.dense.b", "params.dense.w", "params.layers.0", "params.layers.1", "step",
    ]  # fmt: skip
    np.testing.assert_array_equal(got["params.dense.w"], want["params"]["dense"]["w"])
    np.testing.assert_array_equal(got["params.layers.0"], want["params"]["layers"][0])
    np.testing.assert_array_equal(got["params.layers.1"], want["params"]["layers"][1])
    assert got["step"].dtype == np.int64 and got["step"] == 7
    with open(path, "rb") as f:  # the header the format specifies, padded to 8 bytes
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert n % 8 == 0 and header["params.dense.w"]["dtype"] == "F32"
    for n_ranks in (2, 3):
        for blocks, like in run(load_into_layout, n_ranks, args=(path, "safetensors")):
            _assert_blocks(blocks, like)
    assert all("missing ['params.extra']" in e for e in run(_missing, 2, args=(path,)))


def _missing(path):
    like = _sharded(_full())
    like["params"]["extra"] = jnp.zeros(3)
    try:
        spmd.checkpoint.load_safetensors(path, like)
    except spmd.SpmdError as e:
        return str(e)
    return "loaded"


def test_safetensors_errors_name_the_tensor(tmp_path):
    path = str(tmp_path / "w.safetensors")
    safetensors_numpy.save_file({"a": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)},
                                path)  # fmt: skip
    with spmd.Mesh(x=1):
        with pytest.raises(spmd.SpmdError, match=r"not in like \['b'\] \(strict=False"):
            spmd.checkpoint.load_safetensors(path, {"a": jnp.zeros((2, 3))})
        got = spmd.checkpoint.load_safetensors(path, {"a": jnp.zeros((2, 3))}, strict=False)
        np.testing.assert_array_equal(got["a"], np.ones((2, 3)))
        with pytest.raises(spmd.SpmdError, match=r"a has shape \(2, 3\) in .*; like has \(3, 2\)"):
            spmd.checkpoint.load_safetensors(path, {"a": jnp.zeros((3, 2)), "b": jnp.zeros(2)})


def _unwritable(path):
    try:
        spmd.checkpoint.save_safetensors(path, _sharded(_full()))
    except spmd.SpmdError as e:
        return str(e)
    return "saved"


def test_a_safetensors_file_rank_0_cannot_write_is_an_error_on_every_rank(tmp_path):
    """Rank 0 cannot create the file; the others still take part in every gather and all
    raise, naming rank 0's error (no hang)."""
    path = str(tmp_path / "no-such-directory" / "w.safetensors")
    texts = run(_unwritable, 3, args=(path,))
    assert "writing" in texts[0] and "FileNotFoundError" in texts[0], texts
    for text in texts[1:]:
        assert "rank 0 failed: writing" in text and "FileNotFoundError" in text, texts
    assert not list(tmp_path.iterdir())
