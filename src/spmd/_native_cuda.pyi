"""spmd._native_cuda: the GPU half of spmd's native layer (native/python/module_cuda.cc), built
only where nvcc is found: the CUDA XLA FFI handlers, the GPU groups (NCCL, the custom all-reduce's
IPC buffers), the GPU code tables, and the simulation mode for tests and benchmarks."""

from collections.abc import Sequence

def abi_version() -> int: ...

# {"algos", "codecs", "custom_dtypes"}: {name: code}.
def tables() -> dict[str, dict[str, int]]: ...

# Values: a PyCapsule (no name) of each target's XLA_FFI_Handler.
def cuda_handlers() -> dict[str, object]: ...
def nccl_load(library: str, /) -> None: ...
def nccl_version() -> str: ...

# A fresh NCCL unique id: 128 bytes.
def nccl_unique_id() -> bytes: ...

# (name, pci_bus_id, major, minor, multiprocessors) of the current device.
def device_info() -> tuple[str, str, int, int, int]: ...
def group_create(
    id: int, rank: int, size: int, world_ranks: Sequence[int], device: int, timeout_s: float, /
) -> None: ...

# nccl_unique_id: the 128 bytes of nccl_unique_id() on the group's rank 0.
def nccl_init(id: int, nccl_unique_id: bytes, /) -> None: ...

# Returns this rank's IPC handle of the buffer.
def car_alloc(id: int, capacity: int, /) -> bytes: ...

# handles: every rank's car_alloc() result, in group rank order.
def car_open(id: int, handles: Sequence[bytes], /) -> None: ...
def car_write_check(id: int, seed: int, /) -> None: ...

# The world ranks whose pattern did not arrive.
def car_read_check(id: int, seed: int, /) -> list[int]: ...

# capsule: spmd._native.gpu_hooks(), a PyCapsule named "spmd.GpuHooks".
def set_gpu_hooks(
    capsule: object, every_call: bool, sequence_all: bool, timeline: bool, /
) -> None: ...
def gpu_timing_flush(wait_s: float, /) -> None: ...
def group_destroy(id: int, /) -> None: ...

# dtype, algo, codec: codes of tables() (codec 0: none); inputs: each rank's values as bytes.
# Returns (each rank's output as bytes, ms).
def sim_allreduce(
    world: int, dtype: int, algo: int, codec: int, inputs: Sequence[bytes], iters: int, /
) -> tuple[list[bytes], float]: ...

# xs, residuals: each rank's values as bytes; weight: hidden values as bytes.
# Returns (normed, residual_out, ms), the first two each rank's values as bytes.
def sim_allreduce_rmsnorm(
    world: int,
    dtype: int,
    mode: int,
    rows: int,
    hidden: int,
    xs: Sequence[bytes],
    residuals: Sequence[bytes],
    weight: bytes,
    eps: float,
    iters: int,
    /,
) -> tuple[list[bytes], list[bytes], float]: ...

# Mean ms of a device-to-device copy of `nbytes`.
def copy_time(nbytes: int, iters: int, /) -> float: ...
