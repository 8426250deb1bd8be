"""GPU tests: they run where JAX computes on a GPU and spmd's GPU module is built, and skip with
the reason elsewhere. On one GPU:

- the custom all-reduce's kernels (one-shot, two-shot, quantized, fused RMSNorm) over 2-8 ranks
  simulated in one process and one launch (custom_ar.h's simulation mode), against NumPy and the
  CPU reference of the codecs;
- NCCL with a world of one inside jit, with and without CUDA graphs (command buffers);
- the IPC handle exchange and peer-access check between processes sharing the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from spmd.ops._cuda import ALGOS, CODECS, CUSTOM_DTYPE_CODES, native_cuda


def _gpu_reason() -> str:
    if native_cuda() is None:
        return "spmd was built without its GPU module"
    import jax

    if jax.default_backend() != "gpu":
        return f"JAX computes on {jax.default_backend()}, not a GPU"
    return ""


pytestmark = pytest.mark.skipif(bool(_gpu_reason()), reason=_gpu_reason() or "GPU present")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _ranks(world, count, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(count).astype(DTYPES[dtype]) for _ in range(world)]


def _sum_in_rank_order(xs):
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)
    return acc


@pytest.mark.parametrize("world", [2, 4, 6, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
@pytest.mark.parametrize("count", [64, 8 * 1000 + 8, 1 << 20])
def test_custom_allreduce_kernels(world, dtype, algo, count):
    xs = _ranks(world, count, dtype, seed=world)
    outs, _ = native_cuda().sim_allreduce(
        world, CUSTOM_DTYPE_CODES[dtype], ALGOS[algo], 0, [x.tobytes() for x in xs], 3
    )
    want = _sum_in_rank_order(xs).astype(DTYPES[dtype])
    for out in outs:  # bit-identical on every rank, and the rank-order float32 sum
        np.testing.assert_array_equal(np.frombuffer(out, DTYPES[dtype]), want)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_kernel_matches_the_cpu_reference(world, codec, dtype):
    from spmd._native_lib import native

    count = 32 * 5000 + 7
    xs = _ranks(world, count, dtype, seed=7)
    outs, _ = native_cuda().sim_allreduce(
        world, CUSTOM_DTYPE_CODES[dtype], ALGOS["quantized"], CODECS[codec],
        [x.tobytes() for x in xs], 3,
    )  # fmt: skip
    stacked = np.stack([x.astype(np.float32) for x in xs])
    ref = np.frombuffer(
        native().quant_allreduce_reference(CODECS[codec], world, stacked.tobytes()), np.float32
    ).astype(DTYPES[dtype])
    for out in outs:
        np.testing.assert_array_equal(np.frombuffer(out, DTYPES[dtype]), ref)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,hidden", [(7, 4096), (64, 1024), (3, 16384)])
def test_fused_allreduce_rmsnorm_agrees_with_the_two_steps(world, dtype, rows, hidden):
    t = DTYPES[dtype]
    rng = np.random.default_rng(rows)
    xs = [rng.standard_normal((rows, hidden)).astype(t) for _ in range(world)]
    rs = [rng.standard_normal((rows, hidden)).astype(t) for _ in range(world)]
    w = rng.uniform(0.5, 1.5, hidden).astype(t)
    # Each rank adds its own residual (they differ, as with sequence-parallel inputs).
    summed = _sum_in_rank_order(xs).astype(t).astype(np.float32)
    outs = [(summed + r.astype(np.float32)).astype(t) for r in rs]
    results = {}
    for mode in (0, 1, 2):  # all-reduce then norm; fused one-shot; fused two-shot
        normed, res_out, _ = native_cuda().sim_allreduce_rmsnorm(
            world, CUSTOM_DTYPE_CODES[dtype], mode, rows, hidden,
            [x.tobytes() for x in xs], [r.tobytes() for r in rs], w.tobytes(), 1e-6, 2,
        )  # fmt: skip
        results[mode] = [np.frombuffer(n, t).reshape(rows, hidden) for n in normed]
        for got, out in zip(res_out, outs, strict=True):
            np.testing.assert_array_equal(np.frombuffer(got, t).reshape(rows, hidden), out)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for mode, normed in results.items():
        for n, out in zip(normed, outs, strict=True):
            r32 = out.astype(np.float32)
            want = (
                r32 / np.sqrt(np.mean(r32 * r32, -1, keepdims=True) + 1e-6) * w.astype(np.float32)
            )
            np.testing.assert_allclose(n.astype(np.float32), want, rtol=tol, atol=tol, err_msg=mode)


def _run(code: str, env: dict[str, str], nprocs: int = 1) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if nprocs > 1:
        cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(nprocs), *cmd]
    return subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


_NCCL_WORLD_OF_ONE = """
    import jax, jax.numpy as jnp, numpy as np, spmd
    spmd.init()
    x = jnp.arange(4096, dtype=jnp.float32)
    f = jax.jit(lambda x: spmd.allreduce(x * 2.0) + 1.0)
    for _ in range(5):  # command buffers are captured after the first runs
        y = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.arange(4096) * 2.0 + 1.0)
    assert "spmd_cuda_allreduce" in f.lower(x).as_text()
    g = jax.jit(lambda x: spmd.allgather(x))
    np.testing.assert_array_equal(np.asarray(g(x)), np.arange(4096))
    print("ok", spmd.ops.get_backend())
"""


@pytest.mark.parametrize(
    "xla_flags",
    ["--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_command_buffer=CUSTOM_CALL "
     "--xla_gpu_graph_min_graph_size=1"],
    ids=["no-graphs", "cuda-graphs"],
)  # fmt: skip
def test_nccl_world_of_one_inside_jit(xla_flags):
    done = _run(_NCCL_WORLD_OF_ONE, {"SPMD_GPU_BACKEND": "nccl", "XLA_FLAGS": xla_flags})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok nccl" in done.stdout


_IPC_EXCHANGE = """
    import spmd
    from spmd.ops import _cuda
    from spmd.ops._groups import resolve
    comm = spmd.init()
    ref = resolve()
    group = _cuda.registered(ref.gid)
    # NCCL refuses two ranks on one GPU; the IPC buffers and the peer-access check must work.
    assert group.custom, group.reason
    assert not group.nccl and "uplicate" in group.nccl_reason, group.nccl_reason
    print("ok", comm.rank, spmd.ops.get_backend())
    spmd.finalize()
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ipc_exchange_between_processes_sharing_the_gpu(nprocs):
    done = _run(_IPC_EXCHANGE, {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0"}, nprocs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == nprocs and "custom" in done.stdout
