"""Another user of the machine cannot get into a job (docs/security.md).

The attacks run as a second, unprivileged user (``nobody``, through ``setpriv``): these tests
need root to become it, and skip with the reason elsewhere. The job they attack runs as the
user of the test run."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pickle
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.runtime._channel import FileChannel
from spmd.runtime._store import FileStore


def _second_user() -> str | None:
    """Why the second user cannot be had here, or None."""
    if os.geteuid() != 0:
        return "becoming a second user needs root"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return "there is no user 'nobody'"
    return None


needs_second_user = pytest.mark.skipif(_second_user() is not None, reason=str(_second_user()))


def as_nobody(script: str, stdin: bytes = b"") -> None:
    """``script`` (sh) run as the user nobody."""
    nobody = pwd.getpwnam("nobody")
    subprocess.run(
        ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
         "sh", "-ec", script],
        input=stdin, check=True, timeout=30,
    )  # fmt: skip


@pytest.fixture
def shared():
    """A directory every user may write to, as /tmp is (sticky, mode 1777)."""
    path = Path(tempfile.mkdtemp(prefix="spmd-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _RunsCode:
    """A pickle that runs a command when loaded."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _rank_zero_of_two(store: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    """Rank 0 of a torchrun-style job of 2 whose store is ``store``; rank 1 never comes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "PMI", "OMPI_"))}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", SPMD_FILE_STORE_PATH=str(store),
               SPMD_RUN_ID=run_id, SPMD_TIMEOUT="3")  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", "import spmd; spmd.init()"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@needs_second_user
def test_a_store_directory_made_by_another_user_is_refused_and_its_pickles_never_loaded(
    shared, tmp_path
):
    """Finding 1: the store's directory has a name another user can guess; they make it first
    and put a pickle where rank 0 reads rank 1's bootstrap value. The rank refuses the directory,
    naming its owner and mode, and loads nothing from it."""
    marker = tmp_path / "ran"
    key = FileChannel(None, range(2), 0)._key(0, 1)  # rank 1's first bootstrap value
    planted = pickle.dumps(_RunsCode(f"touch {marker}"))
    as_nobody(f"mkdir -m 0777 {shared}/spmd-job-0 && cat > {shared}/spmd-job-0/{key}", planted)
    out = _rank_zero_of_two(shared, "job")
    assert not marker.exists(), "the other user's pickle ran in the job"
    assert out.returncode != 0
    assert (
        f"rank 0: the bootstrap directory {shared}/spmd-job-0 belongs to nobody (uid "
        f"{pwd.getpwnam('nobody').pw_uid}) with mode 0777; spmd uses it only if it belongs to "
        "this user"
    ) in out.stderr, out.stderr


@needs_second_user
def test_a_store_directory_that_is_another_users_link_is_not_followed(shared, tmp_path):
    """Finding 2: a symbolic link where the store's directory goes, to a directory of the job's
    user: nothing is written through it."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    as_nobody(f"ln -s {victim} {shared}/spmd-job-0")
    out = _rank_zero_of_two(shared, "job")
    assert out.returncode != 0
    assert list(victim.iterdir()) == [], "the job wrote through the other user's link"
    assert "(a symbolic link, which spmd does not follow)" in out.stderr, out.stderr


@needs_second_user
def test_a_store_value_another_user_wrote_is_not_read(shared):
    """A file of another user's in the store's directory (put there before the directory
    became private, say) is an error, not a value."""
    store = FileStore(str(shared), "ns", 0, 2.0)
    (shared / "ns").chmod(0o777)
    as_nobody(f"echo planted > {shared}/ns/k")
    (shared / "ns").chmod(0o700)
    with pytest.raises(Exception, match=r"ns/k in the bootstrap store is not a file of this user"):
        store.wait(["k"], "a test", [1])
    store.remove_all()


def test_store_files_are_the_users_alone(tmp_path):
    """Finding 8: the directory is 0700 and each value 0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        store = FileStore(str(tmp_path), "ns", 0, 2.0)
        store.set("k", b"value")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ns").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "ns" / "k").stat().st_mode) == 0o600
    assert store.wait(["k"], "a test", [0]) == [b"value"]
    assert [p.name for p in (tmp_path / "ns").iterdir()] == ["k"]  # no temporary file left
    store.remove_all()
    assert not (tmp_path / "ns").exists()


def test_a_store_directory_others_can_write_to_is_refused(tmp_path):
    """The same user's directory, but group- or world-writable: refused, with its mode."""
    (tmp_path / "ns").mkdir(mode=0o700)
    (tmp_path / "ns").chmod(0o777)
    with pytest.raises(Exception, match=r"ns belongs to .* with mode 0777"):
        FileStore(str(tmp_path), "ns", 3, 2.0)


# -- checkpoints ----------------------------------------------------------------------------------


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path: Path, manifest: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest))


def _saved(tmp_path: Path, name: str = "ck") -> Path:
    spmd.init()
    path = tmp_path / name
    spmd.save(path, {"a": np.arange(6, dtype=np.float32), "b": [np.int32(3), None]})
    return path


def test_a_pickled_structure_is_not_unpickled_unless_trusted(tmp_path):
    """Finding 5: a manifest whose structure is a pickle that runs a command. A load without
    like= refuses it (naming like= and trust=), and the command never runs."""
    path = _saved(tmp_path)
    marker = tmp_path / "ran"
    m = _manifest(path)
    m["structure"] = None
    m["treedef"] = base64.b64encode(pickle.dumps(_RunsCode(f"touch {marker}"))).decode()
    _rewrite(path, m)
    with pytest.raises(spmd.SpmdError, match=r"pass like= .*, or trust=True if you trust"):
        spmd.load(path)
    assert not marker.exists(), "a load without trust=True unpickled the manifest"
    # like= reads the same checkpoint without looking at the pickle.
    got = spmd.load(path, like={"a": np.zeros(6, np.float32), "b": [np.int32(0), None]})
    np.testing.assert_array_equal(got["a"], np.arange(6))


def test_dicts_lists_tuples_and_namedtuples_load_without_a_pickle(tmp_path):
    """What a training loop saves (dicts, lists, tuples, None, optax's namedtuple states) has
    no pickle in the manifest and loads without like= and without trust."""
    spmd.init()
    params = {"w": jnp.ones((2, 3)), "v": [jnp.zeros(2), (np.int8(1), None)], "by_id": {7: 1.5}}
    tree = {"params": params, "opt": optax.adam(1e-3).init(params)}
    spmd.save(tmp_path / "ck", tree)
    m = _manifest(tmp_path / "ck")
    assert m["treedef"] is None and m["structure"] is not None
    got = spmd.load(tmp_path / "ck")
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(tree)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


class _Box:
    """A custom pytree node (its structure is only a pickle)."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.value,), None), lambda _, c: _Box(c[0]))


def test_a_custom_node_needs_like_or_trust(tmp_path):
    spmd.init()
    spmd.save(tmp_path / "ck", {"box": _Box(np.arange(3))})
    with pytest.raises(spmd.SpmdError, match=r"other than dict, list, tuple, None and namedtuples"):
        spmd.load(tmp_path / "ck")
    got = spmd.load(tmp_path / "ck", trust=True)
    np.testing.assert_array_equal(got["box"].value, np.arange(3))


@pytest.mark.parametrize("how", ["..", "absolute", "link"])
def test_a_checkpoint_never_reads_outside_itself(tmp_path, how):
    """Finding 6: a manifest naming a file outside the checkpoint (a ``..`` path or an absolute
    one, with the size and CRC-32 of that file), or a data file that is a symbolic link out:
    refused with an error naming the field; the outside file's bytes are never returned."""
    path = _saved(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(6, dtype=np.float32)[::-1].tobytes())
    m = _manifest(path)
    rec = m["leaves"][0]["files"][0]
    assert m["leaves"][0]["path"] == "['a']" and rec["file"] == "00000.bin"
    rec["crc32"] = zlib.crc32(secret.read_bytes())
    if how == "link":
        (path / "00000.bin").unlink()
        (path / "00000.bin").symlink_to(secret)
        expected = r"cannot read the file 00000\.bin of leaf \['a'\] \(a symbolic link"
    else:
        rec["file"] = "../secret.bin" if how == ".." else str(secret)
        expected = (
            r"manifest\.json: leaves\[0\]\.files\[0\]\.file is '.*secret\.bin'; expected the name "
            r"of a file inside the checkpoint, 00000\.bin or 00000\.<shard>\.bin"
        )
    _rewrite(path, m)
    for like in (None, {"a": np.zeros(6, np.float32), "b": [np.int32(0), None]}):
        with pytest.raises(spmd.SpmdError, match=expected):
            spmd.load(path, like=like)


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda m: m.pop("leaves"), r"leaves is None; expected a list of leaf records"),
        (lambda m: m["leaves"][1].update(dtype="object"), r"leaves\[1\]\.dtype is 'object'"),
        (lambda m: m["leaves"][0].update(shape=[-6]), r"leaves\[0\]\.shape is \[-6\]"),
        (lambda m: m["leaves"][0].update(kind="pickle"), r"leaves\[0\]\.kind is 'pickle'"),
        (
            lambda m: m["leaves"][0]["files"][0].update(index=[[0, 7]]),
            r"leaves\[0\]\.files\[0\]\.index is \[\[0, 7\]\]; expected a \[start, stop\] pair",
        ),
        (lambda m: m["leaves"][0]["files"][0].pop("crc32"), r"files\[0\]\.crc32 is None"),
        (lambda m: m.update(structure={"set": []}), r"structure is \{'set': \[\]\}"),
        (
            lambda m: m.update(structure={"namedtuple": ["os", "system", []]}),
            r"names the namedtuple os\.system, which is not a namedtuple",
        ),
    ],
    ids=["no leaves", "dtype", "shape", "kind", "index", "crc32", "structure", "namedtuple"],
)
def test_a_malformed_manifest_names_the_field(tmp_path, damage, field):
    """Finding 9: each field a load uses is checked, and the error names it (not a KeyError
    or a TypeError from deep inside the reader)."""
    path = _saved(tmp_path)
    m = _manifest(path)
    damage(m)
    _rewrite(path, m)
    with pytest.raises(spmd.SpmdError, match=field) as info:
        spmd.load(path)
    assert "KeyError" not in str(info.value) and "TypeError" not in str(info.value)


def test_a_manifest_nested_too_deeply_is_a_clear_error(tmp_path):
    path = _saved(tmp_path)
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(spmd.SpmdError, match=r"manifest\.json is JSON nested too deeply") as info:
        spmd.load(path)
    assert "RecursionError" not in str(info.value)
    m = _manifest(_saved(tmp_path, "ck2"))
    deep: object = "*"
    for _ in range(300):
        deep = {"list": [deep]}
    m["structure"] = deep
    _rewrite(tmp_path / "ck2", m)
    with pytest.raises(spmd.SpmdError, match=r"structure.* is nested more than 200 deep"):
        spmd.load(tmp_path / "ck2")


def test_a_checkpoint_is_its_owners_alone(tmp_path):
    """Finding 8: the checkpoint's directory 0700, its files 0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        path = _saved(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes == {"manifest.json": 0o600, "00000.bin": 0o600, "00001.bin": 0o600}, modes


# -- spmd-run's cleaner of what killed jobs left --------------------------------------------------

# Above the kernel's largest pid (2**22): no process has it.
_DEAD_PID = 2**22 + 4321


@needs_second_user
def test_the_cleaner_leaves_another_users_links_and_directories_alone_at_once(shared, monkeypatch):
    """Finding 7: another user's symbolic link (to a directory of the job's user) and directory
    under a status directory's name, with a pid no process has. The cleaner touches neither and
    does not wait on them (it used to retry removing the link for a second, each)."""
    from spmd.launch import _job

    mine = shared / "mine"
    mine.mkdir()
    (mine / "lock").touch()
    link, theirs = shared / f"spmd-run-{_DEAD_PID}-a", shared / f"spmd-run-{_DEAD_PID}-b"
    as_nobody(f"ln -s {mine} {link} && mkdir {theirs} && touch {theirs}/lock")
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    waits: list[float] = []
    monkeypatch.setattr(_job.time, "sleep", waits.append)
    _job._remove_stale_status_dirs()
    assert link.is_symlink() and theirs.is_dir() and (theirs / "lock").exists()
    assert (mine / "lock").exists()
    assert waits == []


def test_a_stale_status_directory_is_told_by_its_lock_not_its_pid(tmp_path, monkeypatch):
    """A status directory whose lock nobody holds is a dead job's, even when a process now has
    the pid in its name; one whose lock is held is a running job's, whatever its pid."""
    from spmd.launch import _job

    reused = tmp_path / f"spmd-run-{os.getpid()}-x"  # this test runs with that pid
    running = tmp_path / f"spmd-run-{_DEAD_PID}-y"
    for d in (reused, running):
        d.mkdir()
    (reused / "lock").touch()
    fd = os.open(running / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        _job._remove_stale_status_dirs()
        assert not reused.exists(), "a dead job's directory was kept because its pid is in use"
        assert running.exists(), "a running job's directory was removed"
    finally:
        os.close(fd)
    _job._remove_stale_status_dirs()
    assert not running.exists()
