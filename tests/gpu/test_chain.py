"""The GPU all-reduce chain (quantized -> custom all-reduce -> NCCL) and its switches:
pure functions of size, dtype and topology, so they are checked here without a GPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd._native_lib import native_cuda
from spmd.ops import _gpu_chain
from spmd.ops._gpu_chain import ChainConfig, select_allreduce, select_rmsnorm
from spmd.runtime import GpuGroup, find_native_group, nccl_library
from spmd.runtime._gpu import bounded, settings_differ
from spmd.testing import multirank

UP = GpuGroup(2, True)
KB, MB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "dtype", "op", "expected"),
    [
        (16, "float32", "sum", "one_shot"),
        (MB, "bfloat16", "sum", "one_shot"),  # the 2-rank one-shot limit, inclusive
        (MB + 16, "bfloat16", "sum", "two_shot"),
        (64 * MB, "float32", "sum", "two_shot"),  # the registered buffer, inclusive
        (64 * MB + 16, "float32", "sum", "nccl"),
        (1000, "float32", "sum", "nccl"),  # not a multiple of 16 bytes
        (4096, "float16", "max", "nccl"),  # the custom kernels only sum
        (4096, "int32", "sum", "nccl"),
        (4096, "float64", "sum", "nccl"),
        (4096, "bool", "sum", "nccl"),
    ],
)
def test_chain_by_size_dtype_and_op(nbytes, dtype, op, expected):
    assert select_allreduce(nbytes, np.dtype(dtype), op, UP, ChainConfig()) == expected


def test_one_shot_limit_depends_on_world_size():
    cfg = ChainConfig()
    assert select_allreduce(768 * KB, "float32", "sum", GpuGroup(2, True), cfg) == "one_shot"
    assert select_allreduce(768 * KB, "float32", "sum", GpuGroup(4, True), cfg) == "two_shot"
    assert select_allreduce(384 * KB, "float32", "sum", GpuGroup(4, True), cfg) == "one_shot"
    assert select_allreduce(384 * KB, "float32", "sum", GpuGroup(8, True), cfg) == "two_shot"


def test_without_the_custom_all_reduce_everything_is_nccl():
    down = GpuGroup(3, False, "it takes 2, 4, 6, 8 ranks")
    for n in (16, MB, 32 * MB):
        assert select_allreduce(n, "float32", "sum", down, ChainConfig()) == "nccl"
        assert select_allreduce(n, "float32", "sum", down, ChainConfig(), "int8") == "nccl"


def test_quantized_is_opt_in_and_only_in_its_size_range():
    cfg = ChainConfig()
    assert select_allreduce(8 * MB, "bfloat16", "sum", UP, cfg) == "two_shot"
    assert select_allreduce(8 * MB, "bfloat16", "sum", UP, cfg, "fp8") == "quantized"
    assert select_allreduce(MB - 16, "bfloat16", "sum", UP, cfg, "int4") == "one_shot"  # too small
    assert select_allreduce(MB, "bfloat16", "sum", UP, cfg, "int4") == "quantized"
    # ints and other reductions are never quantized
    assert select_allreduce(8 * MB, "int32", "sum", UP, cfg, "int8") == "nccl"
    assert select_allreduce(8 * MB, "float32", "max", UP, cfg, "int8") == "nccl"
    # the default comes from SPMD_QUANTIZE
    env = ChainConfig.from_env({"SPMD_QUANTIZE": "int8"})
    assert select_allreduce(8 * MB, "float16", "sum", UP, env) == "quantized"
    # the codes of a leaf too large for the buffer: exact paths
    assert select_allreduce(512 * MB, "float32", "sum", UP, cfg, "int8") == "nccl"
    # larger world sizes need larger tensors to gain
    assert select_allreduce(2 * MB, "float16", "sum", GpuGroup(8, True), cfg, "fp8") == "two_shot"
    assert select_allreduce(4 * MB, "float16", "sum", GpuGroup(8, True), cfg, "fp8") == "quantized"


def test_forcing_a_path():
    nccl = ChainConfig.from_env({"SPMD_GPU_TRANSPORT": "nccl"})
    assert select_allreduce(4096, "float32", "sum", UP, nccl) == "nccl"
    assert select_allreduce(8 * MB, "bfloat16", "sum", UP, nccl, "fp8") == "nccl"
    custom = ChainConfig.from_env({"SPMD_GPU_TRANSPORT": "custom"})
    assert select_allreduce(8 * MB, "bfloat16", "sum", UP, custom, "fp8") == "two_shot"
    assert select_allreduce(4096, "int32", "sum", UP, custom) == "nccl"  # what it cannot take
    with pytest.raises(spmd.SpmdError, match="not available for this group: spans nodes"):
        select_allreduce(4096, "float32", "sum", GpuGroup(2, False, "spans nodes"), custom)
    assert ChainConfig.from_env({}, forced="nccl").transport == "nccl"


def test_a_group_without_nccl_names_why():
    no_nccl = GpuGroup(2, True, "", False, "rank 1: Duplicate GPU detected")
    assert select_allreduce(4096, "float32", "sum", no_nccl, ChainConfig()) == "one_shot"
    with pytest.raises(spmd.SpmdError, match=r"int32.*needs NCCL.*Duplicate GPU detected"):
        select_allreduce(4096, "int32", "sum", no_nccl, ChainConfig())


def test_thresholds_from_the_environment():
    cfg = ChainConfig.from_env(
        {
            "SPMD_CUSTOM_AR_MAX_MB": "1",
            "SPMD_CUSTOM_AR_ONE_SHOT_KB": "4",
            "SPMD_QUANTIZE_MIN_KB": "8",
        }
    )
    assert (cfg.custom_max_bytes, cfg.one_shot_max(8), cfg.quantize_min(2)) == (MB, 4 * KB, 8 * KB)
    assert select_allreduce(4 * KB, "float32", "sum", UP, cfg) == "one_shot"
    assert select_allreduce(4 * KB + 16, "float32", "sum", UP, cfg) == "two_shot"
    assert select_allreduce(MB + 16, "float32", "sum", UP, cfg) == "nccl"
    assert select_allreduce(8 * KB, "float32", "sum", UP, cfg, "fp8") == "quantized"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPMD_GPU_TRANSPORT": "gloo"}, "SPMD_GPU_TRANSPORT='gloo' is not a GPU transport"),
        ({"SPMD_QUANTIZE": "fp4"}, "quantize='fp4' is not a codec"),
        ({"SPMD_CUSTOM_AR_MAX_MB": "lots"}, "SPMD_CUSTOM_AR_MAX_MB='lots' is not a number"),
        ({"SPMD_CUSTOM_AR_ONE_SHOT_KB": "-1"}, "must not be negative"),
    ],
)
def test_bad_settings_are_errors(env, message):
    with pytest.raises(spmd.SpmdError, match=message):
        ChainConfig.from_env(env)


@pytest.mark.parametrize(
    ("rows", "hidden", "dtype", "expected"),
    [
        (4, 4096, "bfloat16", "one_shot"),  # 32 KiB
        (128, 4096, "bfloat16", "one_shot"),  # 1 MiB: the 2-rank one-shot limit
        (1024, 4096, "bfloat16", "two_shot"),  # 8 MiB
        (4096, 4096, "float32", "two_shot"),  # 64 MiB: the registered buffer, inclusive
        (4097, 4096, "float32", "nccl"),  # one row more does not fit
        (4, 16384, "float16", "one_shot"),
        (4, 16385, "float16", "nccl"),  # rows longer than the fused kernel takes
        (4, 4096, "float64", "nccl"),
    ],
)
def test_fused_rmsnorm_eligibility(rows, hidden, dtype, expected):
    assert select_rmsnorm(rows, hidden, np.dtype(dtype), UP, ChainConfig()) == expected


def test_fused_rmsnorm_needs_the_custom_all_reduce():
    assert select_rmsnorm(4, 4096, "float32", GpuGroup(6, False, "x"), ChainConfig()) == "nccl"
    nccl = ChainConfig.from_env({"SPMD_GPU_TRANSPORT": "nccl"})
    assert select_rmsnorm(4, 4096, "float32", UP, nccl) == "nccl"


def test_nccl_library_lookup(tmp_path, monkeypatch):
    assert nccl_library({"SPMD_NCCL_LIBRARY": "/opt/nccl/libnccl.so.2"}) == (
        "/opt/nccl/libnccl.so.2"
    )
    # The NCCL wheel's layout: nvidia/nccl/lib/libnccl.so.2 in a namespace package.
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in list(__import__("sys").modules) if m.startswith("nvidia")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    assert nccl_library({}) == str(lib / "libnccl.so.2")


def test_quantize_argument_is_checked():
    with pytest.raises(spmd.SpmdError, match=r"rank 0: allreduce: quantize='fp16' is not a codec"):
        spmd.allreduce(np.ones(4, np.float32), quantize="fp16")


def test_set_transport_takes_the_gpu_names():
    try:
        spmd.ops.set_transport("nccl")
        assert _gpu_chain.chain_config().transport == "nccl"
        spmd.ops.set_transport("custom")
        assert _gpu_chain.chain_config().transport == "custom"
        spmd.ops.set_transport("auto")
        assert _gpu_chain.chain_config().transport == "auto"
        with pytest.raises(spmd.SpmdError, match=r"custom, nccl \(GPU\)"):
            spmd.ops.set_transport("rccl")
    finally:
        spmd.ops.set_transport("auto")


def test_a_join_that_never_returns_is_bounded():
    # NCCL's communicator set-up blocks until every rank joined: _bounded turns a peer that
    # failed inside it into an error after the timeout instead of a hang.
    import threading
    import time

    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(spmd.SpmdError, match=r"rank 3: joining did not finish within 0.2 s"):
        bounded(release.wait, 0.2, "rank 3: joining")
    assert 0.2 <= time.monotonic() - start < 5
    release.set()
    assert bounded(lambda: 42, 5, "quick") == 42
    with pytest.raises(ValueError, match="inside"):
        bounded(lambda: (_ for _ in ()).throw(ValueError("inside")), 5, "failing")


def test_ranks_with_different_settings_are_named():
    same = [ChainConfig(), ChainConfig()]
    assert settings_differ([0, 1], same) == ""
    msg = settings_differ(
        [0, 1, 2], [ChainConfig(), ChainConfig(one_shot_max_bytes=4096), ChainConfig()]
    )
    assert "different all-reduce settings" in msg
    assert "rank 1: ChainConfig(transport='auto', quantize=None" in msg
    assert "one_shot_max_bytes=4096" in msg and msg.count("\n  rank ") == 3


F32, BF16 = np.dtype("float32"), np.dtype("bfloat16")


def test_latency_bound_leaves_of_a_dtype_are_packed_into_one_buffer():
    leaves = [
        (15, F32),  # 60 bytes: padded to 64
        (1000, F32),
        (7, BF16),  # alone in its dtype, but unaligned: packed to be padded
        (1 << 20, F32),  # 4 MiB: two-shot on its own
        (4, np.dtype("int32")),  # NCCL
        (8, BF16),
        (0, F32),  # nothing moves
    ]
    assert _gpu_chain.pack_allreduce(leaves, "sum", UP, ChainConfig()) == [[0, 1], [2, 5]]
    assert [_gpu_chain.padded_count(c, d) for c, d in leaves[:3]] == [16, 1000, 8]


def test_packs_stay_one_shot_and_alignment_alone_justifies_a_pack():
    cfg = ChainConfig()
    # Three 400 KiB float32 leaves: the 2-rank one-shot limit (1 MiB) holds two of them.
    big = [(100 << 10, F32)] * 3
    assert _gpu_chain.pack_allreduce(big, "sum", UP, cfg) == [[0, 1]]
    # At 8 ranks (256 KiB one-shot) none fit together, and aligned leaves are left alone.
    assert _gpu_chain.pack_allreduce(big, "sum", GpuGroup(8, True), cfg) == []
    assert _gpu_chain.pack_allreduce([(4, F32)], "sum", UP, cfg) == []
    assert _gpu_chain.pack_allreduce([(5, F32)], "sum", UP, cfg) == [[0]]


def test_nothing_is_packed_where_the_custom_kernel_does_not_run():
    leaves = [(3, F32), (5, F32)]
    assert _gpu_chain.pack_allreduce(leaves, "max", UP, ChainConfig()) == []
    assert _gpu_chain.pack_allreduce(leaves, "sum", GpuGroup(3, False, "x"), ChainConfig()) == []
    nccl = ChainConfig.from_env({"SPMD_GPU_TRANSPORT": "nccl"})
    assert _gpu_chain.pack_allreduce(leaves, "sum", UP, nccl) == []
    # A leaf the chain quantizes (its threshold lowered to 8 KiB) keeps its own path, and a pack
    # closes before its total would be quantized: packing never changes a leaf's bits.
    cfg = ChainConfig(quantize="int8", quantize_min_bytes=8 * KB)
    mixed = [(3 << 10, F32), (5, F32), (1 << 10, F32), (1 << 10, F32)]
    # 32 + 4096 bytes stay below it; a third leaf would reach it, and alone it needs no pack.
    assert _gpu_chain.pack_allreduce(mixed, "sum", UP, cfg) == [[1, 2]]


@multirank(nprocs=(2,), env={"JAX_PLATFORMS": "cpu"})
def test_a_fused_call_is_lowered_with_its_packs(comm):
    """The GPU lowering, checked on CPU (JAX lowers for a platform it does not run): the packs
    reach the one custom call as flat padded buffers, each with its chain choice. (On a GPU
    machine too the ranks compute on CPU: test_device.py runs the packs on the GPU.)"""
    if native_cuda() is None:
        pytest.skip("spmd was installed without its GPU module (no nvcc at install time)")
    from spmd.ops._primitive import resolve

    native = find_native_group(resolve().gid)
    native.gpu = GpuGroup(comm.size, True)  # the GPU side a GPU node would register
    try:
        tree = {
            "a": jnp.ones((3, 5), jnp.float32),
            "b": jnp.ones((1000,), jnp.float32),
            "c": jnp.ones((7,), jnp.bfloat16),
            "d": jnp.ones((1 << 20,), jnp.float32),
            "e": jnp.ones((4,), jnp.int32),
            "f": jnp.ones((2, 4), jnp.bfloat16),
        }
        lowered = jax.jit(spmd.allreduce).trace(tree).lower(lowering_platforms=("cuda",))
        calls = [ln for ln in lowered.as_text().splitlines() if "@spmd_cuda_allreduce" in ln]
        assert len(calls) == 1, calls
        operands = re.findall(r"tensor<(\w+)>", calls[0].split("} : (")[-1].split(" -> ")[0])
        assert operands == ["1xui8", "1016xf32", "16xbf16", "1048576xf32", "4xi32"], calls[0]
        algos = re.search(r"algos = array<i64: ([\d, ]+)>", calls[0]).group(1)
        assert algos == "1, 1, 2, 0", calls[0]
    finally:
        native.gpu = None


def test_a_pack_never_grows_past_the_buffer_where_nccl_is_down():
    # One-shot limit set above the buffer: two 300 KiB leaves each go one-shot alone, and packed
    # they would not fit; the pack is not made (it raised "needs NCCL").
    no_nccl = GpuGroup(2, True, "", False, "Duplicate GPU detected")
    cfg = ChainConfig(custom_max_bytes=512 * KB, one_shot_max_bytes=4 * MB)
    leaves = [(75 << 10, F32), (75 << 10, F32), (5, F32)]
    assert _gpu_chain.pack_allreduce(leaves, "sum", no_nccl, cfg) == [[1, 2]]


def _gpu_call_comparison(comm):
    import ctypes
    import zlib

    from spmd._native_lib import native
    from spmd.ops._primitive import describe_call, resolve

    r = comm.rank
    x = jnp.ones((4, 4), jnp.float32)

    def texts(f):
        eqns = [e for e in jax.make_jaxpr(f)(x).eqns if e.primitive.name.startswith("spmd_")]
        return [describe_call(e.primitive.name.removeprefix("spmd_"), [v.aval for v in e.invars],
                              e.params) for e in eqns]  # fmt: skip

    # What the lowering writes out: the call as the user wrote it, not as it runs.
    assert texts(lambda x: spmd.allreduce(x)) == ["allreduce(op=sum) of float32[4,4]"]
    assert texts(lambda x: spmd.allreduce(x, op="avg")) == ["allreduce(op=avg) of float32[4,4]"]
    assert texts(lambda x: spmd.allgather(x, axis=1)) == ["allgather(axis=1) of float32[4,4]"]
    assert texts(lambda x: spmd.allgatherv(x, sizes=[4, 4])) == [
        "allgather(sizes=[4,4]) of float32[*,4]"  # the rows differ from rank to rank
    ]
    assert texts(lambda x: spmd.broadcast(x, root=1)) == ["broadcast(root=1) of float32[4,4]"]
    grad = texts(lambda x: jax.grad(lambda x: spmd.allreduce(x).sum())(x))
    assert grad == ["allreduce(op=sum) of float32[4,4]",
                    "allreduce(op=sum) of float32[4,4] [backward pass]"]  # fmt: skip
    # Two ranks of the group take part: not compared.
    assert texts(lambda x: spmd.sendrecv(x, src=1 - r, dst=1 - r)) == [""]

    # The CPU module's comparison, as the GPU handlers call it through the capsule of hooks
    # (spmd/signature.h, GpuHooks: check, sequence, record_begin, record_end).
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    hooks = (ctypes.c_void_p * 5).from_address(get(native().gpu_hooks(), b"spmd.GpuHooks"))
    kind = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p,
                            ctypes.c_size_t)  # fmt: skip
    check = kind(hooks[0])
    sequence = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_size_t,
    )(hooks[1])
    gid = resolve().gid
    error = ctypes.create_string_buffer(2048)
    assert check(gid, b"allreduce(op=sum) of float32[4]", error, 2048) == 0
    mine = f"allreduce(op={'sum' if r == 0 else 'avg'}) of float32[4]".encode()
    assert check(gid, mine, error, 2048) == 1
    text = error.value.decode()
    assert "ranks of the group [0, 1] made different collective calls" in text, text
    assert "rank 0: allreduce(op=sum) of float32[4]" in text, text
    assert "rank 1: allreduce(op=avg) of float32[4]" in text, text
    assert check(123456789, b"anything", error, 2048) == 0  # no such group here: nothing to compare
    # The sequence check of calls after their first run: rank 1's second call differs.
    native().group_sequence_reset(gid)
    comm.barrier()
    calls = [b"allreduce(op=sum) of float32[4]", b"allgather(axis=0) of float32[4]"]
    if r == 1:
        calls[1] = b"allgather(axis=0) of float32[8]"
    # The signature: any hash of the text. The second call fails if the peer made its own.
    c = calls[0]
    assert sequence(gid, zlib.crc32(c), c, len(c), error, 2048) == 0
    comm.barrier()
    sequence(gid, zlib.crc32(calls[1]), calls[1], len(calls[1]), error, 2048)
    comm.barrier()
    c = b"barrier() of"
    assert sequence(gid, zlib.crc32(c), c, len(c), error, 2048) == 1  # both published both, or
    # the error of the second stays
    text = error.value.decode()
    assert "found by the sequence check" in text and "call #2 on this group is" in text, text
    assert "rank 0: allgather(axis=0) of float32[4]" in text, text
    assert "rank 1: allgather(axis=0) of float32[8]" in text, text
    assert sequence(123456789, 1, c, len(c), error, 2048) == 0  # no such group here
    _gpu_records(hooks)


def _gpu_records(hooks):
    """The flight recorder as the GPU handlers write it through the hooks: a call begun, ended
    as enqueued, then given the GPU's times (the timeline's CUDA events)."""
    import ctypes

    from spmd._native_lib import tables
    from spmd.runtime import _recorder

    c = ctypes
    begin = c.CFUNCTYPE(c.c_size_t, c.c_int64, c.c_uint64, c.c_uint64, c.c_uint64, c.c_int32,
                        c.c_int8)(hooks[2])  # fmt: skip
    end = c.CFUNCTYPE(None, c.c_size_t, c.c_int8)(hooks[3])
    times = c.CFUNCTYPE(None, c.c_size_t, c.c_int64, c.c_uint64, c.c_int64, c.c_int64)(hooks[4])
    code = tables()["call_codes"]["allreduce_rmsnorm"]
    group = 987654321  # no such group: only the records

    def mine():
        recs = _recorder.records()
        return recs[recs["group"] == group]

    slot = begin(group, 5, 0xABC, 4096, code, -2)
    end(slot, 3)
    (r,) = mine()
    assert (int(r["call"]), int(r["hash"]), int(r["bytes"])) == (5, 0xABC, 4096)
    assert (int(r["state"]), int(r["transport"])) == (3, -2) and r["end_ns"] >= r["start_ns"] > 0
    times(slot, group, 6, 1, 2)  # another call than the slot's: nothing changes
    assert int(mine()[0]["state"]) == 3
    times(slot, group, 5, 1000, 3500)
    (r,) = mine()
    assert (int(r["state"]), int(r["start_ns"]), int(r["end_ns"])) == (1, 1000, 3500)
    (event,) = [e for e in _recorder.trace_events(mine(), 0, {}) if e["ph"] == "X"]
    assert (event["name"], event["dur"], event["args"]["state"]) == ("allreduce_rmsnorm", 2.5,
                                                                     "done")  # fmt: skip
    np.testing.assert_array_equal(spmd.allreduce(np.ones(2, np.float32)), [2.0, 2.0])


@multirank(nprocs=(2,), env={"JAX_PLATFORMS": "cpu"})
def test_what_the_gpu_handlers_compare_and_how(comm):
    """The GPU handlers' call comparison, checked without a GPU: the text the lowering writes for
    each call, and the CPU module's comparison they call (a difference names each rank's call)."""
    _gpu_call_comparison(comm)


@multirank(nprocs=(2,), env={"JAX_PLATFORMS": "cpu", "SPMD_TRANSPORT": "mpi"})
def test_what_the_gpu_handlers_compare_and_how_over_mpi(comm):
    _gpu_call_comparison(comm)
