"""``MessageQueue``: one writer broadcasting Python objects to the other ranks of a group, through
a ring of slots in shared memory for the readers on the writer's node and a ZMQ socket for the
readers on other nodes (the AITER seed's shared-memory broadcast, written anew for spmd).

Shared memory (one segment, made by the writer)::

    header: magic, slots, slot bytes, local readers, writer pid          (64 bytes)
    per slot: [seq u64 | length u64 | chunk u32 | chunks u32 | flags ... ] (64 + readers, rounded
              to 64 bytes), then its data (slot bytes)

A slot is free when it was never written or every local reader has set its flag in it. The
writer fills a free slot's data, length and chunk numbers, clears the flags and then stores
the message's sequence number: a reader waiting for sequence number s in that slot reads the
data only after it sees s, then sets its flag. The sequence number is stored with release and
loaded with acquire semantics, and so are the flags (native: spmd._native's ``mq_*``), so
that the order holds on every architecture, aarch64's weaker ordering included, not only on
x86-64's. An object longer than a slot takes several consecutive slots. The writer unlinks
the segment as soon as every reader has mapped it, so nothing is left in ``/dev/shm`` whatever
happens to the processes.

Readers on other nodes subscribe to the writer's ZMQ XPUB socket (``pyzmq``); the writer waits
for every subscription before the first message, so none is lost, and sends each pickled object
whole. The socket is a CURVE server (encrypted, authenticated): the writer and each remote reader
make a key pair for the queue, and the public keys travel over the group's own channel (MPI, or
the job's private store), never over the socket. The writer's ZAP handler admits only the
readers' keys, so nobody else receives a message or counts as a reader; a reader admits only the
writer's key, so nothing another process sends on that port (say, after the writer has ended) is
ever unpickled.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import sys
import time
import uuid
from types import SimpleNamespace
from typing import Any

from .._errors import SpmdError
from .._native_lib import native
from ._communicator import Communicator, use_queue_factory

__all__ = ["MessageQueue"]

_MAGIC = 0x5350_4D44_4D51_0001  # "SPMDMQ", version 1
_HEADER = struct.Struct("<QQQQQ")  # magic, slots, slot_bytes, readers, writer pid
_SLOT = struct.Struct("<QQII")  # seq, length, chunk, chunks
_META = struct.Struct("<QII")  # the slot's length, chunk, chunks (after its seq)
_SEQ = struct.Struct("<Q")
_SPIN = 20  # polls before a waiter yields its core (os.sched_yield), then sleeps


def _round(n: int) -> int:
    return (n + 63) // 64 * 64


class MessageQueue:
    """A broadcast queue from rank ``writer`` of ``comm`` to every other rank of it.

    Made collectively (every rank of the group constructs it with the same arguments); then the
    writer calls :meth:`enqueue` and every other rank :meth:`dequeue`, once per message, in
    order. ``slots`` messages may be in flight before the writer waits for the slowest local
    reader; an object longer than ``slot_bytes`` (pickled) takes several slots.

    Example (a world of one has no reader: the queue holds nothing)::

        >>> import spmd
        >>> with spmd.MessageQueue() as q:
        ...     q.enqueue({"step": 1})
    """

    def __init__(
        self,
        comm: Communicator | None = None,
        *,
        writer: int = 0,
        slots: int = 8,
        slot_bytes: int = 1 << 20,
        timeout: float | None = None,
    ) -> None:
        if comm is None:
            from ._state import get_communicator

            comm = get_communicator()
        self.comm = comm
        n = self.comm.size
        if not 0 <= writer < n:
            raise SpmdError(f"writer={writer}; expected a rank of the group, 0..{n - 1}")
        if slots < 1 or slot_bytes < 1:
            raise SpmdError(f"slots={slots}, slot_bytes={slot_bytes}; expected both >= 1")
        self.writer, self.slots, self.slot_bytes = writer, slots, slot_bytes
        self.timeout = float(os.environ.get("SPMD_TIMEOUT", "300")) if timeout is None else timeout
        self.is_writer = self.comm.rank == writer
        nodes = [self.comm.node_ids[w] for w in self.comm.ranks]  # node_ids: by world rank
        self.local = [r for r in range(n) if r != writer and nodes[r] == nodes[writer]]
        self.remote = [r for r in range(n) if r != writer and nodes[r] != nodes[writer]]
        self._data_at = _round(_SLOT.size + len(self.local))  # a slot's data, from its start
        self.stride = self._data_at + slot_bytes
        self._zeros = bytes(len(self.local))
        self.next = 0  # sequence number of the next chunk (writer) / next chunk to read
        self._map: mmap.mmap | None = None
        self._addr = 0  # where the mapping starts, for the native atomics
        self._sock: Any = None
        self._ctx: Any = None
        self._auth: Any = None  # the writer's ZAP handler (a thread of pyzmq's)
        self._keys: tuple[bytes, bytes] | None = None  # this rank's CURVE key pair (public, secret)
        self._readers: frozenset[bytes] = frozenset()  # the remote readers' public keys (writer)
        self._closed = False
        self._setup()

    # -- set-up ----------------------------------------------------------------------------------

    def _setup(self) -> None:
        comm = self.comm
        info: dict[str, Any] = {}
        path = None
        try:
            if self.is_writer and self.local:
                path = f"/dev/shm/spmd-mq-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                size = 64 + self.slots * self.stride
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, size)
                    self._map = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                self._addr = _address(self._map)
                _HEADER.pack_into(self._map, 0, _MAGIC, self.slots, self.slot_bytes,
                                  len(self.local), os.getpid())  # fmt: skip
                info["shm"] = path
            mine = comm.rank
            if self.is_writer and self.remote:
                info["zmq"], info["key"] = self._bind()
            elif mine in self.remote:
                info["key"] = self._keypair()
            # (not broadcast_object, which may itself use a MessageQueue)
            infos = comm.allgather_object(info if self.is_writer or mine in self.remote else None)
            info = infos[self.writer]
            if self.is_writer and self.remote:
                self._readers = frozenset(infos[r]["key"] for r in self.remote)
            if mine in self.local:
                fd = os.open(info["shm"], os.O_RDWR)
                try:
                    self._map = mmap.mmap(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                self._addr = _address(self._map)
                self.flag = self.local.index(mine)
            comm.barrier()  # every local reader has mapped the segment; the writer knows the keys
            if mine in self.remote:
                self._connect(info["zmq"], info["key"])
        finally:
            if path is not None:  # mapped where it is needed: nothing to leave in /dev/shm
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.is_writer and self.remote:
            self._await_subscribers()

    def _zmq(self) -> Any:
        try:
            import zmq
        except ImportError:
            raise SpmdError(
                "a MessageQueue with readers on other nodes needs pyzmq (pip install pyzmq)"
            ) from None
        if not zmq.has("curve"):
            raise SpmdError(
                f"a MessageQueue with readers on other nodes needs ZMQ's CURVE security, which "
                f"this libzmq ({zmq.zmq_version()}) was built without (pyzmq's wheels have it: "
                "pip install --force-reinstall pyzmq)"
            )
        if self._ctx is None:
            self._ctx = zmq.Context()
        return zmq

    def _keypair(self) -> bytes:
        """Make this rank's CURVE key pair; its public key (Z85)."""
        zmq = self._zmq()
        self._keys = zmq.curve_keypair()
        return self._keys[0]

    def _bind(self) -> tuple[str, bytes]:
        """The writer's socket: a CURVE server whose ZAP handler admits the readers' keys only
        (none until the set-up has gathered them). Its endpoint and public key."""
        zmq = self._zmq()
        public = self._keypair()
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        # pyzmq's thread asks callback(domain, key) of each client's public key (Z85).
        admit = SimpleNamespace(callback=lambda domain, key: key in self._readers)
        self._auth.configure_curve_callback("*", admit)
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only new topics
        self._sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a PUB socket drops what passes it
        self._sock.curve_server = True
        assert self._keys is not None
        self._sock.curve_secretkey = self._keys[1]
        host = os.environ.get("SPMD_MQ_HOST", "127.0.0.1")
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}", public

    def _connect(self, endpoint: str, server: bytes) -> None:
        zmq = self._zmq()
        assert self._keys is not None
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # no limit: nothing dropped for a slow reader
        self._sock.curve_serverkey = server  # only the writer's key is accepted
        self._sock.curve_publickey, self._sock.curve_secretkey = self._keys
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")

    def _await_subscribers(self) -> None:
        """XPUB reports each subscription: wait for all, so that no message is sent before a
        remote reader can receive it."""
        deadline = time.monotonic() + self.timeout
        seen = 0
        while seen < len(self.remote):
            if not self._sock.poll(timeout=max(1, int((deadline - time.monotonic()) * 1000))):
                raise SpmdError(
                    f"MessageQueue: {len(self.remote) - seen} of the readers on other nodes "
                    f"{[self.comm.ranks[r] for r in self.remote]} did not subscribe within "
                    f"{self.timeout:g} s"
                )
            if self._sock.recv()[:1] == b"\x01":
                seen += 1

    # -- messages --------------------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send ``obj`` (picklable) to every reader (the writer only)."""
        if not self.is_writer:
            raise SpmdError(f"enqueue on rank {self.comm.rank}, a reader; the writer is rank "
                            f"{self.comm.ranks[self.writer]}")  # fmt: skip
        self._check_open()
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise SpmdError(
                f"MessageQueue.enqueue: a {type(obj).__name__} cannot be pickled ({e})"
            ) from None
        if self._sock is not None:
            self._sock.send(data, copy=len(data) < 65536)
        if self._map is None:
            return
        limit = self.timeout if timeout is None else timeout
        m, n, size, addr = self._map, len(self.local), self.slot_bytes, self._addr
        lib = native
        chunks = max(1, -(-len(data) // size))
        view = memoryview(data) if chunks > 1 else data
        for c in range(chunks):
            base = 64 + (self.next % self.slots) * self.stride
            flags = base + _SLOT.size
            if _SEQ.unpack_from(m, base)[0] and not lib.mq_all_set(addr + flags, n):
                self._wait_free(base, limit)
            part = view[c * size : (c + 1) * size] if chunks > 1 else data
            start = base + self._data_at
            m[start : start + len(part)] = part
            m[flags : flags + n] = self._zeros
            _META.pack_into(m, base + 8, len(data), c, chunks)
            lib.mq_store(addr + base, self.next + 1)  # the sequence number last (release)
            self.next += 1

    def _wait_free(self, base: int, limit: float) -> None:
        m = self._map
        assert m is not None
        n = len(self.local)
        flags = base + _SLOT.size
        deadline = time.monotonic() + limit
        spins = 0
        lib = native
        while True:
            seq = _SEQ.unpack_from(m, base)[0]
            if seq == 0 or lib.mq_all_set(self._addr + flags, n):
                return
            spins += 1
            if spins > _SPIN:
                if time.monotonic() > deadline:
                    behind = [self.comm.ranks[self.local[i]] for i in range(n)
                              if m[flags + i] == 0]  # fmt: skip
                    raise SpmdError(
                        f"MessageQueue.enqueue: the readers {behind} have not read message "
                        f"chunk #{seq} within {self.timeout:g} s (all {self.slots} slots are "
                        "full); every reader must dequeue each message"
                    )
                _pause(spins)

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next object the writer sent (a reader only)."""
        if self.is_writer:
            raise SpmdError(f"dequeue on rank {self.comm.rank}, the writer of the queue")
        self._check_open()
        limit = self.timeout if timeout is None else timeout
        if self._sock is not None:
            if not self._sock.poll(timeout=max(0, int(limit * 1000))):
                raise self._late(limit)
            return pickle.loads(self._sock.recv(copy=False).buffer)
        m = self._map
        assert m is not None
        lib = native
        parts: list[Any] = []
        total = chunks = 1
        c = 0
        while c < chunks:
            base = 64 + (self.next % self.slots) * self.stride
            if lib.mq_load(self._addr + base) != self.next + 1:  # acquire: the data after it
                self._wait_written(base, limit)
            _, total, chunk, chunks = _SLOT.unpack_from(m, base)
            start = base + self._data_at
            size = min(self.slot_bytes, total - chunk * self.slot_bytes)
            if chunks == 1:
                obj = pickle.loads(m[start : start + size])
            else:
                parts.append(m[start : start + size])
            lib.mq_mark(self._addr + base + _SLOT.size + self.flag)  # release: read before it
            self.next += 1
            c += 1
        return obj if chunks == 1 else pickle.loads(b"".join(parts))

    def _wait_written(self, base: int, limit: float) -> None:
        m = self._map
        assert m is not None
        want = self.next + 1
        deadline = time.monotonic() + limit
        spins = 0
        load = native.mq_load
        while load(self._addr + base) != want:
            spins += 1
            if spins > _SPIN:
                if time.monotonic() > deadline:
                    raise self._late(limit)
                if spins % 500 == 0 and not _alive(_HEADER.unpack_from(m, 0)[4]):
                    raise SpmdError(
                        f"MessageQueue.dequeue: the writer, rank "
                        f"{self.comm.ranks[self.writer]}, has ended (its process is gone) "
                        f"before sending message chunk #{want}"
                    )
                _pause(spins)

    def _late(self, limit: float) -> SpmdError:
        return SpmdError(
            f"MessageQueue.dequeue: nothing from the writer, rank "
            f"{self.comm.ranks[self.writer]}, within {limit:g} s"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SpmdError("the MessageQueue is closed")

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the shared memory and the socket (not a collective)."""
        if self._closed:
            return
        self._closed = True
        if self._map is not None:
            self._map.close()
            self._map = None
            self._addr = 0
        if self._sock is not None:
            # The writer's messages still queued in ZMQ are delivered first (up to the timeout).
            self._sock.close(linger=int(self.timeout * 1000) if self.is_writer else 0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not sys.is_finalizing():
            try:
                self.close()
            except Exception:
                pass


def _address(m: mmap.mmap) -> int:
    """Where mapping ``m`` starts (the buffer export ctypes takes ends at once, so that the
    mapping can still be closed)."""
    anchor = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _pause(spins: int) -> None:
    """Between polls, past the first _SPIN: give the core away (the ranks may outnumber the
    cores), and after some thousands of polls sleep, so that a long wait costs no core."""
    if spins < 20 * _SPIN:
        os.sched_yield()
    else:
        time.sleep(5e-5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


use_queue_factory(MessageQueue)
