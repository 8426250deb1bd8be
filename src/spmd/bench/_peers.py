"""The implementations measured: spmd inside ``jax.jit`` and the peers a user would pick instead
(mpi4py on numpy buffers, out of place and in place; mpi4jax inside ``jax.jit``;
torch.distributed with gloo), each bound to one op and size as a call to time and a way to get
its result, with the inputs every rank gives them and the result each rank must get."""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import SpmdError

PEERS = ("mpi4py", "mpi4jax", "torch")
SPMD = "spmd"
# Implementations in column order; a peer name expands to its implementations.
PEER_IMPLS = {
    "mpi4py": ("mpi4py", "mpi4py-inplace"),
    "mpi4jax": ("mpi4jax",),
    "torch": ("torch-gloo",),
}

Array = npt.NDArray[Any]


class Unsupported(Exception):
    """This implementation has no such operation (the row shows n/a)."""


# --------------------------------------------------------------------------------------------
# Inputs and expected results (exact in every dtype: small integers)


def pattern(count: int, rank: int, dtype: np.dtype[Any], offset: int = 0) -> Array:
    """Rank ``rank``'s input: element i is (offset + i) % 7 + rank."""
    return ((np.arange(offset, offset + count) % 7) + rank).astype(dtype)


def expected(op: str, count: int, rank: int, n: int, dtype: np.dtype[Any]) -> Array:
    """This rank's flat result of ``op`` over inputs ``pattern(., r)``, computed locally."""
    k = count // n
    if op == "allreduce":
        return (n * (np.arange(count) % 7) + n * (n - 1) // 2).astype(dtype)
    if op == "allgather":
        return (np.tile(np.arange(k) % 7, n) + np.repeat(np.arange(n), k)).astype(dtype)
    if op == "reduce_scatter":
        return (n * (np.arange(rank * k, (rank + 1) * k) % 7) + n * (n - 1) // 2).astype(dtype)
    if op == "broadcast":
        return pattern(count, 0, dtype)
    if op == "all_to_all":
        block = np.arange(rank * k, (rank + 1) * k) % 7
        return (np.tile(block, n) + np.repeat(np.arange(n), k)).astype(dtype)
    raise SpmdError(f"unknown op {op!r}")


def op_input(op: str, count: int, rank: int, n: int, dtype: np.dtype[Any]) -> Array:
    """The input of ``op`` on this rank: allgather takes this rank's block, the others all."""
    if op == "allgather":
        return pattern(count // n, rank, dtype)
    return pattern(count, rank, dtype)


# --------------------------------------------------------------------------------------------
# Implementations: one bound (op, size) is a call that completes and a way to get its result


@dataclass
class Bound:
    call: Callable[[], object]  # one complete call (the timed unit)
    result: Callable[[], Array]  # run once on the check input; this rank's flat result
    after_check: Callable[[], None] = lambda: None  # reset buffers an in-place call mutated
    # Run on every rank before the result and before each series of calls (spmd under a forced
    # transport sets it here: between series, when no call is in flight).
    enter: Callable[[], None] = lambda: None


@dataclass
class Env:
    """What the implementations need: the world, the dtype and the imported peers."""

    rank: int
    n: int
    dtype: np.dtype[Any]
    mpi: Any  # mpi4py.MPI
    world: Any  # MPI.COMM_WORLD
    mpi4jax: Any = None
    mpi4jax_comm: Any = None
    torch: Any = None
    dist: Any = None


def _jax_bound(fn: Callable[[Any], Any], x_np: Array) -> Bound:
    import jax
    import jax.numpy as jnp

    f = jax.jit(fn)
    x = jnp.asarray(x_np)

    def call() -> object:
        return f(x).block_until_ready()

    def result() -> Array:
        return np.asarray(f(x)).reshape(-1)

    return Bound(call, result)


def bind_spmd(env: Env, op: str, count: int, transport: str | None = None) -> Bound:
    """spmd's op; with ``transport``, under that transport (``spmd-<transport>``)."""
    from .. import ops

    fns: dict[str, Callable[[Any], Any]] = {
        "allreduce": lambda x: ops.allreduce(x),
        "allgather": lambda x: ops.allgather(x),
        "reduce_scatter": lambda x: ops.reduce_scatter(x),
        "broadcast": lambda x: ops.broadcast(x, root=0),
        "all_to_all": lambda x: ops.all_to_all(x),
    }
    bound = _jax_bound(fns[op], op_input(op, count, env.rank, env.n, env.dtype))
    if transport is not None:
        bound.enter = lambda: ops.set_transport(transport)
    return bound


def first(out: Any) -> Any:
    """mpi4jax < 0.4 returns (result, token); later versions the result alone."""
    return out[0] if isinstance(out, tuple) else out


def bind_mpi4jax(env: Env, op: str, count: int) -> Bound:
    m, comm, n, sum_ = env.mpi4jax, env.mpi4jax_comm, env.n, env.mpi.SUM
    fns: dict[str, Callable[[Any], Any]] = {
        "allreduce": lambda x: first(m.allreduce(x, op=sum_, comm=comm)),
        "allgather": lambda x: first(m.allgather(x, comm=comm)),
        "broadcast": lambda x: first(m.bcast(x, 0, comm=comm)),
        "all_to_all": lambda x: first(m.alltoall(x.reshape(n, -1), comm=comm)),
    }
    if op not in fns:
        raise Unsupported(f"mpi4jax has no {op}")
    return _jax_bound(fns[op], op_input(op, count, env.rank, env.n, env.dtype))


def bind_mpi4py(env: Env, op: str, count: int, in_place: bool) -> Bound:
    MPI, comm, rank, n, dtype = env.mpi, env.world, env.rank, env.n, env.dtype
    k = count // n
    x = op_input(op, count, rank, n, dtype)
    if not in_place:
        out = np.empty(count if op != "reduce_scatter" else k, dtype)
        calls: dict[str, Callable[[], object]] = {
            "allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
            "allgather": lambda: comm.Allgather(x, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(x, root=0),
            "all_to_all": lambda: comm.Alltoall(x, out),
        }

        def result() -> Array:
            calls[op]()
            return (x if op == "broadcast" else out).copy()

        return Bound(calls[op], result)

    buf = np.zeros(count, dtype)  # zeros: repeated in-place sums stay 0, never overflow
    ip = MPI.IN_PLACE
    calls = {
        "allreduce": lambda: comm.Allreduce(ip, buf, op=MPI.SUM),
        "allgather": lambda: comm.Allgather(ip, buf),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(ip, buf, op=MPI.SUM),
        "broadcast": lambda: comm.Bcast(buf, root=0),
        "all_to_all": lambda: comm.Alltoall(ip, buf),
    }

    def result_in_place() -> Array:
        if op == "allgather":  # this rank's block sits at its place in the output
            buf[rank * k : (rank + 1) * k] = x
        else:
            buf[:] = x
        calls[op]()
        return (buf[:k] if op == "reduce_scatter" else buf).copy()

    def reset() -> None:
        if op in ("allreduce", "reduce_scatter"):
            buf[:] = 0

    return Bound(calls[op], result_in_place, reset)


def bind_torch(env: Env, op: str, count: int) -> Bound:
    torch, dist, n, rank = env.torch, env.dist, env.n, env.rank
    k = count // n
    x = torch.from_numpy(op_input(op, count, rank, n, env.dtype).copy())
    out = torch.empty(k if op == "reduce_scatter" else count, dtype=x.dtype)
    if op == "allreduce":  # torch.distributed reduces in place only

        def call() -> object:
            return dist.all_reduce(x)

    elif op == "allgather":

        def call() -> object:
            return dist.all_gather_into_tensor(out, x)

    elif op == "reduce_scatter":

        def call() -> object:
            return dist.reduce_scatter_tensor(out, x)

    elif op == "broadcast":

        def call() -> object:
            return dist.broadcast(x, src=0)

    else:

        def call() -> object:
            return dist.all_to_all_single(out, x)

    original = x.clone()

    def result() -> Array:
        x.copy_(original)
        call()
        res = x if op in ("allreduce", "broadcast") else out
        return np.asarray(res.numpy()).copy()

    def reset() -> None:
        if op == "allreduce":
            x.zero_()

    return Bound(call, result, reset)


def bind(env: Env, impl: str, op: str, count: int) -> Bound:
    if impl == SPMD:
        return bind_spmd(env, op, count)
    if impl.startswith(f"{SPMD}-"):
        return bind_spmd(env, op, count, transport=impl[len(SPMD) + 1 :])
    if impl == "mpi4py":
        return bind_mpi4py(env, op, count, in_place=False)
    if impl == "mpi4py-inplace":
        return bind_mpi4py(env, op, count, in_place=True)
    if impl == "mpi4jax":
        return bind_mpi4jax(env, op, count)
    if impl == "torch-gloo":
        return bind_torch(env, op, count)
    raise SpmdError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# Which peers run: every rank tries them, and all ranks skip the same ones


def agree(world: Any, error: str | None) -> str | None:
    """Every rank's error, so that all ranks skip together: the first one, or None."""
    errors: list[str | None] = world.allgather(error)
    return next((e for e in errors if e), None)


def load_peers(env: Env, wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Import the wanted peers; returns the implementations that run and why others do not."""
    impls: list[str] = []
    skipped: dict[str, str] = {}
    for peer in PEERS:
        if peer not in wanted:
            skipped[peer] = "not requested (--peers)"
            continue
        error: str | None = None
        try:
            if peer == "mpi4jax":
                env.mpi4jax = importlib.import_module("mpi4jax")
                env.mpi4jax_comm = env.world.Dup()
            elif peer == "torch":
                error = _init_torch(env)
        except Exception as e:
            error = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        error = agree(env.world, error)
        if error is None:
            impls += PEER_IMPLS[peer]
        else:
            skipped[peer] = error
    return impls, skipped


def _init_torch(env: Env) -> str | None:
    env.torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    port = None
    if env.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = env.world.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=env.rank, world_size=env.n)
    env.dist = dist
    return None
