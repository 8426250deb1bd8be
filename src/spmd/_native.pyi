"""spmd._native: the CPU half of spmd's native layer (native/python/module.cc): the CPU XLA FFI
handlers, the native groups they run on, and the code tables Python and C++ share."""

from collections.abc import Sequence
from typing import TypedDict

class _Tables(TypedDict):
    # What tables() returns (spmd/tables.h); not a runtime name of the module.
    reduce_ops: dict[str, int]
    transports: dict[str, int]
    wires: dict[str, int]
    staging: dict[str, int]
    roles: dict[str, int]
    role_shift: int
    call_codes: dict[str, int]
    error_marker: str
    dtypes: tuple[str, ...]
    algos: dict[str, int]
    codecs: dict[str, int]
    custom_dtypes: dict[str, int]

def abi_version() -> int: ...
def xla_ffi_api_version() -> tuple[int, int]: ...
def tables() -> _Tables: ...

# Values: a PyCapsule (no name) of each target's XLA_FFI_Handler.
def cpu_handlers() -> dict[str, object]: ...

# constants: the 14 MPI handles (MPI._handleof) of BYTE, C_BOOL, INT8_T, UINT8_T, INT32_T,
# INT64_T, FLOAT, DOUBLE, SUM, PROD, MAX, MIN, LAND, LOR, in that order. Returns whether the
# large-count calls were chosen.
def mpi_load(
    library: str,
    constants: Sequence[int],
    prefer_large_count: bool,
    classic_max_count: int,
    /,
) -> bool: ...
def mpi_has_large_count(library: str, /) -> bool: ...
def group_create(
    id: int,
    rank: int,
    size: int,
    world_ranks: Sequence[int],
    timeout_s: float,
    one_shot_max: int,
    /,
) -> None: ...

# staging: a code of tables()["staging"] (ValueError otherwise).
def group_attach_shm(
    id: int,
    which: int,
    name: str,
    create: bool,
    rank: int,
    size: int,
    world_ranks: Sequence[int],
    chunk: int,
    staging: int,
    /,
) -> None: ...

# comm_handle: an MPI communicator's handle (MPI._handleof).
def group_attach_mpi(
    id: int, which: int, comm_handle: int, rank: int, size: int, world_ranks: Sequence[int], /
) -> None: ...
def group_set_nodes(id: int, node_of: Sequence[int], /) -> None: ...

# code: a code of tables()["transports"] (ValueError otherwise).
def group_set_transport(id: int, code: int, /) -> None: ...

# Collective over the group: the mean hop time in ns on its rank 0, NaN on the others.
def group_shm_hop_ns(id: int, /) -> float: ...
def shm_dumps_stack(on: bool, /) -> None: ...

# Returns the port the peer watch's server listens on.
def watch_listen(host: str, token: str, /) -> int: ...
def watch_stop() -> None: ...
def mpi_oversubscribed(on: bool, /) -> None: ...

# [(world_ranks, call, seconds waited)] of the communicators waiting in a collective.
def mpi_watch_waits() -> list[tuple[list[int], int, float]]: ...
def mpi_watch_verdict(world_ranks: Sequence[int], call: int, gone: str, late: str, /) -> None: ...

# [(world_ranks, call, error)] of the collectives this process failed, each returned once.
def mpi_watch_failures() -> list[tuple[list[int], int, str]]: ...
def shm_mark_leaving() -> None: ...

# capacity: >= 0 (0: stop); path "": in memory.
def recorder_open(path: str, capacity: int, /) -> None: ...

# The ring's header and records (b"" when none is open).
def recorder_snapshot() -> bytes: ...

# A PyCapsule named "spmd.GpuHooks", for spmd._native_cuda.set_gpu_hooks.
def gpu_hooks() -> object: ...
def group_sequence_reset(id: int, /) -> None: ...

# described: the call written out ("s#": str, or read-only bytes). Raises on a mismatch.
def group_sequence(id: int, described: str | bytes, /) -> None: ...
def group_destroy(id: int, /) -> None: ...
def board_use(id: int, /) -> None: ...

# The MessageQueue atomics; address: an address in the queue's mapping, as an int.
def mq_load(address: int, /) -> int: ...
def mq_store(address: int, value: int, /) -> None: ...
def mq_mark(address: int, /) -> None: ...
def mq_all_set(address: int, n: int, /) -> bool: ...

# Returns a handle for board_poll and board_end.
def board_wait(kind: str, members: Sequence[int], n: int, what: str, /) -> int: ...

# "" or the deadlock the wait is part of.
def board_poll(handle: int, /) -> str: ...
def board_end(handle: int, /) -> None: ...

# codec: a code of tables()["codecs"]; data and result: float32 values as bytes.
def quant_roundtrip(codec: int, data: bytes, /) -> bytes: ...

# data: world * n float32 values, rank-major, as bytes; returns the n float32 values as bytes.
def quant_allreduce_reference(codec: int, world: int, data: bytes, /) -> bytes: ...
