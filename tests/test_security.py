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


_RUNS_CODE_SOURCE = """
class _RunsCode:
    def __init__(self, command):
        self.command = command
    def __reduce__(self):
        return (os.system, (self.command,))
"""


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


# -- sockets --------------------------------------------------------------------------------------

SPMD_RUN = [sys.executable, "-m", "spmd.cli.run"]

# The helpers each side of an attack uses to wait for the other: files in the shared directory.
_SYNC = """
import json, os, sys, time
from pathlib import Path
d = Path(sys.argv[1])
def wait(name):
    deadline = time.monotonic() + 60
    while not (d / name).exists():
        assert time.monotonic() < deadline, f"{name} never came"
        time.sleep(0.05)
def put(name, text=""):
    (d / (name + ".part")).write_text(text)
    os.replace(d / (name + ".part"), d / name)
"""


@pytest.fixture
def nobody_python():
    """The command that runs this Python as the user nobody (with the test's packages), or a
    skip with the reason."""
    why = _second_user()
    if why is not None:
        pytest.skip(why)
    nobody = pwd.getpwnam("nobody")
    command = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
               "--clear-groups", sys.executable]  # fmt: skip
    probe = subprocess.run([*command, "-c", "import zmq"], capture_output=True, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"the user nobody cannot run {sys.executable} with pyzmq")
    return command


def _attack(shared: Path, nobody_python: list[str], job: str, attacker: str):
    """A 2-rank job on two (simulated) nodes running ``job``, and the user nobody running
    ``attacker`` at the same time; both get the shared directory as argv[1] and _SYNC's
    helpers. Their outputs (spmd-run's, nobody's)."""
    (shared / "job.py").write_text(_SYNC + job)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "PMI", "OMPI_"))}
    proc = subprocess.Popen(
        [*SPMD_RUN, "-n", "2", "--nodes", "2", sys.executable, str(shared / "job.py"), str(shared)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    other = subprocess.Popen(
        [*nobody_python, "-c", _SYNC + attacker, str(shared)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
    )  # fmt: skip
    try:
        theirs = other.communicate(timeout=120)[0]
        ours = proc.communicate(timeout=120)[0]
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert other.returncode == 0, theirs
    assert proc.returncode == 0, ours
    return ours, theirs


def test_a_queue_subscriber_without_the_key_gets_nothing_and_a_port_taken_over_feeds_nothing(
    shared, nobody_python, tmp_path
):
    """Finding 3: a MessageQueue's writer on one node, its reader on another (ZMQ). The other
    user subscribes twice (plain, and with CURVE keys of its own and the writer's public key):
    neither gets a message, and the reader gets every one. Once the writer has closed, the
    other user binds its port and publishes a pickle that runs a command: the reader, still
    waiting, never loads it and times out."""
    pytest.importorskip("zmq")
    marker = tmp_path / "ran"
    job = """
import spmd
comm = spmd.init()
q = spmd.MessageQueue(comm, timeout=30)
assert q.remote == [1], q.remote
if comm.rank == 0:
    put("queue", json.dumps([q._sock.last_endpoint.decode(), q._keys[0].decode()]))
    wait("listening")
    for i in range(20):
        q.enqueue(("secret", i))
    comm.barrier()
    q.close()  # the writer is done; its port is free
    put("closed")
else:
    assert [q.dequeue() for _ in range(20)] == [("secret", i) for i in range(20)]
    print("rank 1 read 20 messages", flush=True)
    comm.barrier()
    try:
        print("rank 1 got", q.dequeue(timeout=4), flush=True)
    except spmd.SpmdError as e:
        print(f"rank 1: {e}", flush=True)
comm.barrier()
"""
    attacker = f"""
import pickle, zmq
wait("queue")
endpoint, server = json.loads((d / "queue").read_text())
ctx = zmq.Context()
plain = ctx.socket(zmq.SUB)
plain.connect(endpoint)
plain.subscribe(b"")
keyed = ctx.socket(zmq.SUB)
keyed.curve_serverkey = server.encode()
keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
keyed.connect(endpoint)
keyed.subscribe(b"")
time.sleep(1.0)
put("listening")
got = 0
deadline = time.monotonic() + 1.5
while time.monotonic() < deadline:
    for s in (plain, keyed):
        if s.poll(50):
            s.recv()
            got += 1
print("the other user got", got, "messages")
wait("closed")
fake = ctx.socket(zmq.XPUB)
for _ in range(100):
    try:
        fake.bind(endpoint)
        break
    except zmq.ZMQError:
        time.sleep(0.05)
else:
    raise SystemExit("could not take the port over")
bad = {pickle.dumps(_RunsCode(f"touch {marker}"))!r}
deadline = time.monotonic() + 4
while time.monotonic() < deadline:
    fake.send(bad)
    time.sleep(0.05)
print("the other user sent its pickle")
"""
    attacker = "import os\n" + _RUNS_CODE_SOURCE + attacker
    ours, theirs = _attack(shared, nobody_python, job, attacker)
    assert "the other user got 0 messages" in theirs, theirs
    assert "the other user sent its pickle" in theirs, theirs
    assert "rank 1 read 20 messages" in ours, ours
    assert "rank 1: MessageQueue.dequeue: nothing from the writer, rank 0, within 4 s" in ours, ours
    assert not marker.exists(), "the other user's pickle ran in the job"


def test_a_watch_client_without_the_token_gets_nothing_and_a_silent_one_delays_nobody(
    shared, nobody_python
):
    """Finding 4: the peer watch of a job on two (simulated) nodes. The other user's requests
    (the old protocol, and a made-up token) get no answer, no stack print and no rank's wait,
    and its made-up report of a failed collective fails nothing; while it holds 8 connections
    that say nothing, rank 1 still gets rank 0's answer at once."""
    job = """
import jax.numpy as jnp
import spmd
from spmd.runtime import _watch
comm = spmd.init()
w = _watch._watch
assert w is not None, "no peer watch"
if comm.rank == 0:
    put("watch", json.dumps(w.addresses[0][:2]))
    wait("done")
else:
    wait("holding")
    start = time.monotonic()
    answer = w.ask(0, [0, 1])
    took = time.monotonic() - start
    print(f"rank 1 asked rank 0: pid {answer['pid']} in {took:.3f} s", flush=True)
    assert took < 0.4, took
    put("asked")
comm.barrier()
total = float(spmd.allreduce(jnp.ones(2)).sum())
print(f"rank {comm.rank} pid {os.getpid()} sum {total}", flush=True)
"""
    attacker = """
import socket
wait("watch")
host, port = json.loads((d / "watch").read_text())
replies = []
forged = b" F 1 0 0,1 forged failure\\n"  # collective #1 of [0, 1] failed on rank 0
bad = b"x" * 32
requests = [b"1 0,1\\n", b"1 \\n", bad + b" 1 0,1\\n", bad + forged, bad + b" W\\n"]
for request in requests:
    with socket.create_connection((host, port), timeout=3) as conn:
        conn.sendall(request)
        replies.append(conn.recv(100).decode())
print("the other user's replies:", replies, flush=True)
silent = [socket.create_connection((host, port), timeout=3) for _ in range(8)]
put("holding")
wait("asked")
put("done")
"""
    ours, theirs = _attack(shared, nobody_python, job, attacker)
    assert "the other user's replies: ['', '', '', '', '']" in theirs, theirs
    assert "rank 1 pid" in ours and "sum 4.0" in ours, ours  # the collective ran
    pid0 = next(line.split()[-3] for line in ours.splitlines() if "rank 0 pid" in line)
    assert f"rank 1 asked rank 0: pid {pid0} in" in ours, ours
    assert "most recent call first" not in ours, "the other user had a rank print its stack"


def test_segments_and_the_flight_recorder_are_the_users_alone_whatever_the_umask(tmp_path):
    """Under umask 000 (which would leave whatever spmd does not set itself open to all):
    spmd-run's status directory is 0700, each rank's flight recorder 0600, and every
    shared-memory segment a rank has mapped (the collectives', a MessageQueue's; MPICH's too)
    0600, read through the mappings since spmd unlinks its segments once mapped."""
    script = tmp_path / "modes.py"
    script.write_text(
        "import os, stat, jax.numpy as jnp, spmd\n"
        "comm = spmd.init()\n"
        "spmd.allreduce(jnp.ones(1000))\n"
        "q = spmd.MessageQueue(comm)\n"
        "status = os.environ['SPMD_RUN_STATUS_DIR']\n"
        "ring = os.path.join(status, f'rank{comm.rank}.ring')\n"
        "mode = lambda st: oct(stat.S_IMODE(st.st_mode))\n"
        "print(comm.rank, 'status', mode(os.stat(status)), 'ring', mode(os.stat(ring)))\n"
        "for line in open('/proc/self/maps'):\n"
        "    parts = line.split()\n"
        "    if len(parts) >= 6 and parts[5].startswith('/dev/shm/'):\n"
        "        st = os.stat(f'/proc/self/map_files/{parts[0]}')\n"
        "        print(comm.rank, 'segment', parts[5], mode(st), st.st_uid == os.getuid())\n"
        "q.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "PMI", "OMPI_"))}
    # umask set by a shell: a preexec_fn would fork this process, which JAX may have started.
    out = subprocess.run(
        ["sh", "-c", 'umask 000 && exec "$@"', "sh", *SPMD_RUN, "-n", "2", sys.executable,
         str(script)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        assert f"{rank} status 0o700 ring 0o600" in lines, out.stdout
        segments = [line.split() for line in lines if line.startswith(f"{rank} segment ")]
        names = {s[2] for s in segments}
        assert any(n.startswith("/dev/shm/spmd-mq-") for n in names), out.stdout
        assert any(n.startswith("/dev/shm/spmd-") and "-mq-" not in n for n in names), out.stdout
        assert [(s[3], s[4]) for s in segments] == [("0o600", "True")] * len(segments), out.stdout


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
