"""spmd.save / spmd.load: round trips of every dtype and leaf kind, sharded arrays saved once
per distinct shard and loaded at other world sizes and layouts, the ZeRO resume scenario
(saved at 4 ranks with stage 3, resumed at 1-3 ranks with stage 1 or data_parallel, and the
reverse) with parity against the uninterrupted run, the sampler state in the metadata, a writer
killed mid-save, and the errors for damaged checkpoints and bad input."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd import PartitionSpec as P
from spmd.checkpoint import load, metadata, save
from spmd.data import DistributedSampler
from spmd.sharded import ShardedArray
from spmd.testing import run

from ._checkpoint_writer import small_tree
from .transforms._model import global_batches, init_params, loss_fn

HERE = Path(__file__).resolve().parent


def _manifest(path):
    return json.loads((Path(path) / "manifest.json").read_text())


def _leaf(manifest, keystr):
    return next(e for e in manifest["leaves"] if e["path"] == keystr)


def _assert_same(got, want, what=""):
    """Equal values and dtypes, leaf by leaf, and the same kind of value."""
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def, f"{what}: {g_def} != {w_def}"
    for g, w in zip(g_leaves, w_leaves, strict=True):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array)), (
            what,
            type(g),
            type(w),
        )
        assert np.asarray(g).dtype == np.asarray(w).dtype, (what, np.asarray(g).dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


# -- one process ---------------------------------------------------------------------------------


def _mixed_tree():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)}
    return {
        "params": params,
        "opt": optax.adam(1e-3).init(params),  # (ScaleByAdamState(count, mu, nu), EmptyState())
        "dtypes": [
            jnp.asarray(rng.standard_normal(5), jnp.float16),
            jnp.asarray(rng.standard_normal((2, 3)), jnp.bfloat16),
            jnp.asarray(rng.integers(-1000, 1000, (4,)), jnp.int32),
            jnp.asarray(rng.integers(-100, 100, (2, 2)), jnp.int8),
            jnp.asarray([True, False, True]),
            np.asarray(rng.standard_normal(3), np.float64),  # float64 without jax x64: numpy
            np.zeros((0, 3), np.float32),  # zero-size
        ],
        "scalars": (3, 2.5, True, np.float32(1.25), np.int64(-4), jnp.asarray(7, jnp.int32)),
    }


def test_round_trip_one_rank_with_and_without_like(tmp_path):
    spmd.init()
    tree = _mixed_tree()
    meta = {"step": 10, "note": "hello", "nested": {"lr": [0.1, 0.01]}}
    save(tmp_path / "ck", tree, metadata=meta)

    # without like: the structure comes back from the pickled treedef, every leaf as its kind
    out = load(tmp_path / "ck")
    _assert_same(out, tree, "no like")
    assert isinstance(out["opt"][0], optax.ScaleByAdamState)
    assert type(out["scalars"][0]) is int and type(out["scalars"][2]) is bool
    assert isinstance(out["dtypes"][5], np.ndarray) and out["dtypes"][5].dtype == np.float64
    assert out["dtypes"][1].dtype == jnp.bfloat16
    assert metadata(tmp_path / "ck") == meta

    # with like: the tree itself, and abstract shapes
    _assert_same(load(tmp_path / "ck", like=tree), tree, "like")
    abstract = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )
    _assert_same(load(tmp_path / "ck", like=abstract), tree, "ShapeDtypeStruct like")

    m = _manifest(tmp_path / "ck")
    assert (m["format"], m["version"], m["checksum"], m["world_size"]) == (
        "spmd.checkpoint",
        1,
        "crc32",
        1,
    )
    w = _leaf(m, "['params']['w']")
    assert (w["shape"], w["dtype"], w["kind"]) == ([3, 4], "float32", "jax")
    assert w["files"][0]["index"] == [[0, 3], [0, 4]] and w["files"][0]["bytes"] == 48
    assert _leaf(m, "['opt'][0].mu['w']")["dtype"] == "float32"
    # one file per leaf, nothing else besides the manifest; no temporary directories left
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == sorted([f["file"] for e in m["leaves"] for f in e["files"]] + ["manifest.json"])
    assert len(files) == len(jax.tree_util.tree_leaves(tree)) + 1
    assert os.listdir(tmp_path) == ["ck"]


def test_save_replaces_atomically_and_cleans_up(tmp_path):
    spmd.init()
    path = tmp_path / "ck"
    save(path, {"a": np.arange(3)}, metadata={"v": 1})
    # leftovers of interrupted saves (a save's 32-hex-digit id): removed by the next successful
    # save; the user's own directories of similar names are neither removed nor read
    (tmp_path / f"ck.tmp-{'d' * 32}").mkdir()
    (tmp_path / f"ck.tmp-{'d' * 32}" / "00000.bin").write_bytes(b"xx")
    for mine in ("ck.old-run1", "ck.tmp-notes"):
        (tmp_path / mine).mkdir()
        (tmp_path / mine / "keep.txt").write_text("mine")
    save(path, {"a": np.arange(3) + 1, "b": 2.0}, metadata={"v": 2})
    _assert_same(load(path), {"a": np.arange(3) + 1, "b": 2.0})
    assert metadata(path) == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old-run1", "ck.tmp-notes"]
    for mine in ("ck.old-run1", "ck.tmp-notes"):
        assert (tmp_path / mine / "keep.txt").read_text() == "mine"
        shutil.rmtree(tmp_path / mine)
    # no metadata is an empty dict; an empty directory may be the target
    (tmp_path / "empty").mkdir()
    save(tmp_path / "empty", [np.ones(2, np.float32)])
    assert metadata(tmp_path / "empty") == {}


def test_a_symlinked_path_is_followed(tmp_path):
    """Saving to a link replaces the checkpoint it points to; the link stays a link."""
    spmd.init()
    (tmp_path / "runs").mkdir()
    save(tmp_path / "runs" / "step-1", {"a": np.arange(3)})
    os.symlink(os.path.join("runs", "step-1"), tmp_path / "latest")
    save(tmp_path / "latest", {"a": np.arange(3) + 5}, metadata={"v": 2})
    assert os.path.islink(tmp_path / "latest")
    for where in ("latest", os.path.join("runs", "step-1")):
        np.testing.assert_array_equal(load(tmp_path / where)["a"], np.arange(3) + 5)
        assert metadata(tmp_path / where) == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == ["latest", "runs"]
    assert os.listdir(tmp_path / "runs") == ["step-1"]
    # a link to a checkpoint not written yet: written where it points
    os.symlink(os.path.join("runs", "step-2"), tmp_path / "next")
    save(tmp_path / "next", {"a": np.arange(2)})
    assert sorted(os.listdir(tmp_path / "runs")) == ["step-1", "step-2"]
    np.testing.assert_array_equal(load(tmp_path / "runs" / "step-2")["a"], np.arange(2))


def test_load_falls_back_to_the_previous_checkpoint_between_the_renames(tmp_path):
    """A save killed between 'rename path -> path.old-*' and 'rename tmp -> path'."""
    spmd.init()
    save(tmp_path / "ck", {"a": np.arange(4)}, metadata={"v": "old"})
    old, incomplete = "1234" * 8, "0" * 32  # a save's id: 32 hex digits
    os.rename(tmp_path / "ck", tmp_path / f"ck.old-{old}")
    (tmp_path / f"ck.old-{incomplete}").mkdir()  # incomplete (no manifest): never chosen
    with pytest.warns(UserWarning, match=f"ck is missing; reading ck.old-{old}"):
        out = load(tmp_path / "ck")
    np.testing.assert_array_equal(out["a"], np.arange(4))
    with pytest.warns(UserWarning):
        assert metadata(tmp_path / "ck") == {"v": "old"}
    # the next save publishes path and removes the stale directories
    save(tmp_path / "ck", {"a": np.arange(2)})
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_zero_d_shards_and_big_endian_arrays(tmp_path):
    spmd.init()
    tree = {"s": spmd.shard(jnp.float32(3.5), P()), "be": np.arange(4, dtype=">f4")}
    save(tmp_path / "ck", tree)
    out = load(tmp_path / "ck", like=tree)
    assert isinstance(out["s"], ShardedArray) and float(out["s"].local) == 3.5
    assert out["be"].dtype == np.float32 and out["be"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert float(load(tmp_path / "ck")["s"]) == 3.5  # without like: the whole array


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    spmd.init()
    path = tmp_path / "ck"
    with pytest.raises(spmd.SpmdError, match=r"rank 0: .*metadata\['step'\] is a int64"):
        save(path, {"a": np.ones(2)}, metadata={"step": np.int64(3)})
    with pytest.raises(spmd.SpmdError, match=r"metadata has the key 1 \(int\), not a str"):
        save(path, {"a": np.ones(2)}, metadata={1: "x"})
    with pytest.raises(spmd.SpmdTypeError, match=r"metadata is a list"):
        save(path, {"a": np.ones(2)}, metadata=[1])
    with pytest.raises(spmd.SpmdTypeError, match=r"rank 0: .*leaf \['f'\] is a str"):
        save(path, {"a": np.ones(2), "f": "text"})
    with pytest.raises(spmd.SpmdTypeError, match=r"PRNG key.*key_data"):
        save(path, {"k": jax.random.key(0)})
    assert os.listdir(tmp_path) == []  # not even a temporary directory
    # a directory that is not a checkpoint is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(spmd.SpmdError, match=r"not an spmd checkpoint; refusing to replace"):
        save(tmp_path / "mine", {"a": np.ones(2)})
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_like_that_differs_names_the_leaf(tmp_path):
    spmd.init()
    tree = {"a": jnp.ones((2, 3)), "b": {"c": jnp.zeros(4, jnp.int32)}}
    save(tmp_path / "ck", tree)
    with pytest.raises(
        spmd.SpmdError,
        match=r"rank 0: .*like has 3 leaves, the checkpoint 2; leaf 1 is \['b'\]\['x'\] in like "
        r"but \['b'\]\['c'\]",
    ):
        load(tmp_path / "ck", like={"a": tree["a"], "b": {"x": tree["b"]["c"], "y": 1}})
    with pytest.raises(
        spmd.SpmdError,
        match=r"leaf \['a'\] was saved with shape \(2, 3\) and dtype float32, but like= expects "
        r"shape \(3, 2\) and dtype float32",
    ):
        load(tmp_path / "ck", like={"a": jnp.ones((3, 2)), "b": tree["b"]})
    with pytest.raises(spmd.SpmdError, match=r"dtype int32, but like= expects .* dtype float32"):
        load(tmp_path / "ck", like={"a": tree["a"], "b": {"c": jnp.zeros(4)}})


class _Scaled:
    """A pytree node whose auxiliary data (a function) does not pickle."""

    def __init__(self, value, fn):
        self.value, self.fn = value, fn


jax.tree_util.register_pytree_node(
    _Scaled, lambda s: ((s.value,), s.fn), lambda fn, children: _Scaled(children[0], fn)
)


def test_a_structure_that_does_not_pickle_loads_with_like(tmp_path):
    spmd.init()
    tree = {"s": _Scaled(jnp.arange(3.0), lambda x: 2 * x)}
    save(tmp_path / "ck", tree)
    assert _manifest(tmp_path / "ck")["treedef"] is None
    with pytest.raises(spmd.SpmdError, match=r"could not be pickled when it was saved; pass like="):
        load(tmp_path / "ck")
    out = load(tmp_path / "ck", like=tree)
    assert out["s"].fn is tree["s"].fn
    np.testing.assert_array_equal(out["s"].value, np.arange(3.0))


def test_damaged_checkpoints_give_clear_errors(tmp_path):
    spmd.init()
    tree = {"a": np.arange(100, dtype=np.float32), "b": np.arange(6, dtype=np.int32)}

    def fresh(name):
        save(tmp_path / name, tree)
        m = _manifest(tmp_path / name)
        return tmp_path / name, _leaf(m, "['a']")["files"][0]

    path, rec = fresh("flip")
    raw = bytearray((path / rec["file"]).read_bytes())
    raw[17] ^= 0x01  # one bit
    (path / rec["file"]).write_bytes(bytes(raw))
    crc = f"{rec['crc32']:#010x}"
    with pytest.raises(
        spmd.SpmdError,
        match=rf"rank 0: .*file {rec['file']} of leaf \['a'\] is corrupt: its CRC-32 is 0x[0-9a-f]"
        rf"{{8}}, the manifest expects {crc}",
    ):
        load(path)

    path, rec = fresh("deleted")
    os.remove(path / rec["file"])
    with pytest.raises(
        spmd.SpmdError, match=rf"file {rec['file']} of leaf \['a'\] is missing from .*deleted"
    ):
        load(path)

    path, rec = fresh("truncated")
    with open(path / rec["file"], "r+b") as f:
        f.truncate(150)
    with pytest.raises(spmd.SpmdError, match=r"is truncated: it has 150 bytes, expected 400"):
        load(path)

    path, _ = fresh("version")
    m = _manifest(path)
    m["version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(spmd.SpmdError, match=r"format version 99; this spmd reads version 1"):
        load(path)

    path, _ = fresh("nomanifest")
    os.remove(path / "manifest.json")
    with pytest.raises(spmd.SpmdError, match=r"has no manifest.json, so it is not a complete"):
        load(path)
    with pytest.raises(spmd.SpmdError, match=r"rank 0: .*no checkpoint at .*nowhere"):
        load(tmp_path / "nowhere")
    with pytest.raises(spmd.SpmdError, match=r"no checkpoint at"):
        metadata(tmp_path / "nowhere")


# -- killed writer --------------------------------------------------------------------------------


def _writer(path, which):
    """A plain ``python`` (a world of one: no launcher variables, no torchrun-style store)."""
    launcher = ("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return subprocess.Popen(
        [sys.executable, str(HERE / "_checkpoint_writer.py"), str(path), which],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck"
    a = _writer(path, "small")
    out, _ = a.communicate(timeout=60)
    assert a.returncode == 0, out.decode()
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}

    b = _writer(path, "large")
    deadline = time.monotonic() + 60
    partial: list[str] = []
    while time.monotonic() < deadline and b.poll() is None:
        tmp = glob.glob(f"{path}.tmp-*")
        partial = glob.glob(f"{tmp[0]}/*.bin") if tmp else []
        if partial:  # it has started writing the large arrays: kill it mid-save
            break
        time.sleep(0.002)
    still_running = b.poll() is None
    b.send_signal(signal.SIGKILL)
    out, _ = b.communicate()
    assert still_running and partial, f"the writer finished before it was killed: {out.decode()}"
    assert b.returncode == -signal.SIGKILL

    # A, exactly, and nothing of B at path; B's remains only in path.tmp-*
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    _assert_same(load(path), small_tree())
    assert metadata(path) == {"which": "small"}
    assert [os.path.basename(p) for p in glob.glob(f"{path}.tmp-*")] != []
    # the next save replaces A and removes the killed writer's directory
    spmd.init()
    save(path, {"x": np.ones(2)})
    assert os.listdir(tmp_path) == ["ck"]


# -- several ranks: sharded arrays ---------------------------------------------------------------


def _full(shape, dtype, seed):
    x = np.random.default_rng(seed).integers(-50, 50, size=shape)
    return jnp.asarray(x.astype(dtype))


def _sharded_tree(n):
    """Leaves over the world (uneven, and with empty shards), and over a dp x tp mesh."""
    tp = 2 if n % 2 == 0 else 1
    mesh = spmd.Mesh(dp=n // tp, tp=tp)
    full = {
        "rows": _full((7, 3), np.float32, 1),  # 7 rows over n ranks: uneven
        "cols": _full((2, n + 1), jnp.bfloat16, 2),  # split along dim 1
        "few": _full((2, 3), np.int8, 3),  # 2 rows over n ranks: empty shards at n > 2
        "tp": _full((5, 4), np.float32, 4),  # P("tp"): replicated over dp
        "rep": _full((3,), np.int32, 5),
    }
    tree = {
        "rows": spmd.shard(full["rows"], P("dp")),
        "cols": spmd.shard(full["cols"], P(None, "dp")),
        "few": spmd.shard(full["few"], P("dp")),
        "tp": spmd.shard(full["tp"], P("tp"), mesh=mesh),
        "rep": full["rep"],
        "n": 1.5,
    }
    return tree, {**full, "n": 1.5}, mesh


def sharded_round_trip(directory):
    comm = spmd.init()
    n = comm.size
    tree, full, mesh = _sharded_tree(n)
    path = Path(directory) / "ck"
    save(path, tree, metadata={"size": n})

    # without like: full arrays, shards reassembled
    out = load(path)
    for k in full:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(full[k]), err_msg=k)
        assert np.asarray(out[k]).dtype == np.asarray(full[k]).dtype
    # with like: this rank's shard, padding zeros, exactly as spmd.shard makes it
    back = load(path, like=tree)
    for k in ("rows", "cols", "few", "tp"):
        assert isinstance(back[k], ShardedArray) and back[k].spec == tree[k].spec
        assert back[k].mesh is tree[k].mesh
        np.testing.assert_array_equal(np.asarray(back[k].local), np.asarray(tree[k].local))
        np.testing.assert_array_equal(np.asarray(back[k].gather()), np.asarray(full[k]))
    # another layout: the rows leaf split along dim 1 over the mesh's dp axis
    other = load(path, like={**tree, "rows": spmd.shard(full["rows"], P(None, "dp"), mesh=mesh)})
    want = spmd.shard(full["rows"], P(None, "dp"), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(other["rows"].local), np.asarray(want.local))

    m = _manifest(path)
    files = {e["path"]: [f["index"] for f in e["files"]] for e in m["leaves"]}
    return n, files, sorted(os.listdir(path))


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_sharded_arrays_round_trip_and_each_shard_is_written_once(tmp_path, nprocs):
    results = run(sharded_round_trip, nprocs, args=(str(tmp_path),))
    n, files, listing = results[0]
    assert all(r == results[0] for r in results)
    chunk = -(-7 // n)
    assert files["['rows']"] == [[[s, min(7, s + chunk)], [0, 3]] for s in range(0, 7, chunk)]
    # n + 1 columns in chunks of 2: the last ranks' shards are empty and get no file
    assert files["['cols']"] == [[[0, 2], [s, min(n + 1, s + 2)]] for s in range(0, n + 1, 2)]
    assert files["['few']"] == [[[0, 1], [0, 3]], [[1, 2], [0, 3]]]  # empty shards: no file
    tp = 2 if n % 2 == 0 else 1
    # replicated over dp: one file per distinct shard, not per rank
    assert (
        files["['tp']"] == [[[0, 3], [0, 4]], [[3, 5], [0, 4]]] if tp == 2 else [[[0, 5], [0, 4]]]
    )
    assert len(files["['rep']"]) == 1 and len(files["['n']"]) == 1
    n_files = sum(len(v) for v in files.values())
    assert len(listing) == n_files + 1 and "manifest.json" in listing
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def spread_writes(directory):
    """Large replicated leaves are written by several ranks. To see who wrote which, each rank
    passes its own rank as the value (a user's error: replicated leaves must agree)."""
    comm = spmd.init()
    mib = 1 << 20
    tree = {
        "big": [jnp.full((k * mib // 4,), comm.rank, jnp.float32) for k in (4, 3, 2, 1, 1, 1)],
        "small": jnp.full((100,), comm.rank, jnp.int32),  # under 1 MiB: rank 0 writes it
    }
    path = Path(directory) / "ck"
    save(path, tree)
    out = load(path)
    writers = [int(np.asarray(x)[0]) for x in out["big"]]
    assert all(np.all(np.asarray(x) == w) for x, w in zip(out["big"], writers, strict=True))
    return writers, int(np.asarray(out["small"])[0])


@pytest.mark.parametrize("nprocs", [2, 3])
def test_large_replicated_leaves_are_written_by_several_ranks(tmp_path, nprocs):
    writers, small = run(spread_writes, nprocs, args=(str(tmp_path),))[0]
    # Largest first, each to the rank with the fewest bytes so far (ties: the lowest rank).
    if nprocs == 2:
        # MiB so far after each leaf (rank 0, rank 1): 4,0 | 4,3 | 4,5 | 5,5 | 6,5 | 6,6
        assert writers == [0, 1, 1, 0, 0, 1]
    else:
        # (rank 0, 1, 2): 4,0,0 | 4,3,0 | 4,3,2 | 4,3,3 | 4,4,3 | 4,4,4
        assert writers == [0, 1, 2, 2, 1, 2]
    assert small == 0


def test_the_write_plan_evens_out_bytes_per_rank():
    from spmd.checkpoint._plan import plan as _plan

    full = ((0, 8), (0, 1024))
    # 4 ranks: 6 replicated leaves of 32 KiB (float32 8 x 1024) and 2 MiB ones, and a leaf
    # sharded in 2 halves held by ranks {0, 1} and {2, 3} (dp replicas of a tp shard).
    halves = [((0, 4), (0, 1024)), ((4, 8), (0, 1024))]

    def summary(rank):
        leaves = [("['s']", "sharded", (8, 1024), "float32", "P('tp')", halves[rank // 2])]
        for k in range(6):
            leaves.append((f"['r{k}']", "jax", (8, 64 * 1024), "float32", None, None))
        leaves.append(("['tiny']", "jax", (8, 1024), "float32", None, full))
        return leaves

    plan = _plan([summary(r) for r in range(4)], "test")
    writers = [[f.writer for f in p.files] for p in plan]
    assert writers[0] == [0, 2]  # each half by a rank that holds it, the first by rank 0
    assert writers[-1] == [0]  # 32 KiB: rank 0
    load = [0] * 4
    for p, nbytes in zip(plan[1:-1], [2 << 20] * 6, strict=True):
        load[p.files[0].writer] += nbytes
    # the two ranks that wrote no shard take the first two big leaves, then it alternates
    assert [p.files[0].writer for p in plan[1:-1]] == [1, 3, 0, 2, 1, 3]
    assert load == [2 << 20, 4 << 20, 2 << 20, 4 << 20]


def errors_on_every_rank(directory):
    comm = spmd.init()
    tree, _, _ = _sharded_tree(comm.size)
    path = Path(directory) / "ck"
    save(path, tree)
    m = _manifest(path)
    last = _leaf(m, "['rows']")["files"][-1]["file"]  # only the last rank reads it
    if comm.rank == 0:
        raw = bytearray((path / last).read_bytes())
        raw[0] ^= 0xFF
        (path / last).write_bytes(bytes(raw))
    comm.barrier()
    with pytest.raises(spmd.SpmdError) as e:
        load(path, like=tree)
    msg = str(e.value)
    assert msg.startswith(f"rank {comm.rank}: spmd.load(")
    assert f"file {last} of leaf ['rows'] is corrupt" in msg
    if comm.rank != comm.size - 1:
        assert "failed because another rank did" in msg
    comm.barrier()

    # bad input on some ranks: every rank raises before anything is written
    bad = Path(directory) / "bad"
    solo = spmd.get_communicator([[r] for r in range(comm.size)])  # groups of one
    # (leaves in sorted key order: 'cols' has 2 x 4 elements at 3 ranks)
    with pytest.raises(spmd.SpmdError, match=r"group hold \d of the 8 elements of .* \['cols'\]"):
        save(bad, tree, group=solo)  # no group holds every shard
    differs = {**tree, "rep": jnp.zeros(4 if comm.rank == 1 else 3, jnp.int32)}
    with pytest.raises(spmd.SpmdError) as e:
        save(bad, differs)
    assert str(e.value).startswith(f"rank {comm.rank}: spmd.save(")
    assert "rank 0 has ['rep']: replicated, shape (3,), dtype int32, rank 1 has ['rep']: " in str(
        e.value
    )
    with pytest.raises(
        spmd.SpmdError, match=r"rank 2: spmd\.save\(.*metadata\['step'\] is a int64"
    ):
        save(bad, tree, metadata={"step": np.int64(1) if comm.rank == 2 else 1})
    # a shard whose local array does not have the layout's shape on rank 1 (here the wrong
    # rows): refused on every rank before anything is written, so "ck" is not replaced
    rows = tree["rows"]
    local = jnp.zeros((rows.local_shape[0] + 1, 3)) if comm.rank == 1 else rows.local
    wrong = {**tree, "rows": ShardedArray(local, rows.shape, rows.spec, rows.mesh)}
    with pytest.raises(spmd.SpmdError, match=r"\['rows'\] .* local shard has shape"):
        save(path, wrong)
    # each rank its own path (a per-rank timestamp): refused, naming every rank's path
    with pytest.raises(spmd.SpmdError) as e:
        save(Path(directory) / f"step-{comm.rank}", tree)
    listed = ", ".join(f"rank {r}: {Path(directory).resolve()}/step-{r}" for r in range(comm.size))
    assert f"the ranks passed different paths ({listed})" in str(e.value)
    comm.barrier()
    assert not os.path.exists(bad) and sorted(os.listdir(directory)) == ["ck"]
    assert _manifest(path) == m  # the checkpoint in place is untouched
    return msg


def test_errors_are_raised_on_every_rank(tmp_path):
    """A corrupt shard only rank 2 reads; shards no group covers; trees, metadata or paths that
    differ between ranks."""
    msgs = run(errors_on_every_rank, 3, args=(str(tmp_path),))
    assert len(msgs) == 3 and "rank 2: spmd.load(" in msgs[0]


# -- several ranks: the ZeRO resume scenario ------------------------------------------------------

STEPS_BEFORE = 2  # steps trained before the checkpoint
SAMPLES, SAMPLER_BATCH = 50, 4


def _tx():
    return optax.adam(0.05)


def _step_fn(params, opt_state, batch):
    loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = _tx().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _strategy(name):
    if name == "dp":
        return spmd.data_parallel(_step_fn), lambda p, o: (p, o)
    step = spmd.zero_shard(_step_fn, stage=int(name[-1]))
    return step, step.shard


def _batches():
    # 24 rows per global batch: divisible by 1, 2, 3 and 4 ranks, so every world size trains on
    # the same global batches
    return global_batches(STEPS_BEFORE + 1, 3)


def train_and_save(directory, strategy):
    comm = spmd.init()
    step, shard = _strategy(strategy)
    batches = _batches()
    params = spmd.broadcast_params(init_params())
    params, opt_state = shard(params, _tx().init(params))
    for b in batches[:STEPS_BEFORE]:
        params, opt_state, _ = step(params, opt_state, spmd.data.shard_batch(b))
    sampler = DistributedSampler(SAMPLES, seed=3)
    it = sampler.batches(SAMPLER_BATCH)
    next(it), next(it)
    save(
        Path(directory) / "ck",
        {"params": params, "opt_state": opt_state},
        metadata={"step": STEPS_BEFORE, "sampler": sampler.state_dict(), "strategy": strategy},
    )
    remaining = comm.allgather_object(np.concatenate(list(it)).tolist())
    # the uninterrupted run's next step, for the resumed runs to match
    params, _, _ = step(params, opt_state, spmd.data.shard_batch(batches[STEPS_BEFORE]))
    params = spmd.gather(params)
    if comm.rank == 0:
        np.savez(Path(directory) / "next.npz", **{k: np.asarray(v) for k, v in params.items()})
        (Path(directory) / "remaining.json").write_text(json.dumps(remaining))
    comm.barrier()
    return sorted(
        (e["path"], len(e["files"]), e["kind"]) for e in _manifest(Path(directory) / "ck")["leaves"]
    )


def resume(directory, strategy):
    spmd.init()
    step, shard = _strategy(strategy)
    path = Path(directory) / "ck"
    meta = metadata(path)
    assert meta["step"] == STEPS_BEFORE
    params0 = init_params(seed=5)  # other values: everything must come from the checkpoint
    like_params, like_opt = shard(params0, _tx().init(params0))
    state = load(path, like={"params": like_params, "opt_state": like_opt})
    kinds = sorted(
        {
            type(x).__name__
            for x in jax.tree_util.tree_leaves(state, is_leaf=spmd.sharded.is_sharded)
        }
    )
    params, _, _ = step(
        state["params"],
        state["opt_state"],
        spmd.data.shard_batch(_batches()[STEPS_BEFORE]),
    )
    want = np.load(Path(directory) / "next.npz")
    for k, v in spmd.gather(params).items():
        np.testing.assert_allclose(np.asarray(v), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # the sampler resumes where it stopped (at the world size it was saved with)
    remaining = json.loads((Path(directory) / "remaining.json").read_text())
    saved = meta["sampler"]
    for r, rest in enumerate(remaining):
        s = DistributedSampler(SAMPLES, seed=3, num_replicas=saved["num_replicas"], rank=r)
        s.load_state_dict(saved)
        assert np.concatenate(list(s.batches(SAMPLER_BATCH))).tolist() == rest
    # without like: full arrays whatever the saved layout
    full = load(path)
    np.testing.assert_array_equal(
        np.asarray(full["params"]["w1"]), np.asarray(spmd.gather(state["params"])["w1"])
    )
    assert isinstance(full["opt_state"][0], optax.ScaleByAdamState)
    return kinds


def test_zero3_checkpoint_at_4_ranks_resumes_at_1_2_3_ranks(tmp_path):
    saved = run(train_and_save, 4, args=(str(tmp_path), "stage3"))[0]
    # params and moments sharded: one file per non-empty shard (w1: 6 rows in chunks of 2)
    assert ("['params']['w1']", 3, "sharded") in saved
    assert ("['params']['b1']", 4, "sharded") in saved
    assert ("['opt_state'][0].mu['b1']", 4, "sharded") in saved
    assert ("['opt_state'][0].count", 1, "jax") in saved
    assert run(resume, 1, args=(str(tmp_path), "dp")) == [["ArrayImpl"]]
    kinds = run(resume, 2, args=(str(tmp_path), "stage1"))
    assert kinds[0] == ["ArrayImpl", "ShardedArray"]
    run(resume, 3, args=(str(tmp_path), "stage1"))
    run(resume, 3, args=(str(tmp_path), "dp"))


def test_stage1_checkpoint_at_2_ranks_resumes_at_4_ranks_with_stage3(tmp_path):
    saved = run(train_and_save, 2, args=(str(tmp_path), "stage1"))[0]
    assert ("['params']['w1']", 1, "jax") in saved  # stage 1: parameters replicated
    assert ("['opt_state'][0].nu['w2']", 2, "sharded") in saved
    kinds = run(resume, 4, args=(str(tmp_path), "stage3"))
    assert kinds[0] == ["ArrayImpl", "ShardedArray"]
