"""GPU tests: they run where JAX computes on a GPU and spmd's GPU module is built, and skip with
the reason elsewhere. On one GPU:

- the custom all-reduce's kernels (one-shot, two-shot, quantized, fused RMSNorm) over 2-8 ranks
  simulated in one process and one launch (custom_ar.h's simulation mode), against NumPy and the
  CPU reference of the codecs;
- every NCCL collective with a world of one inside jit, with and without CUDA graphs (command
  buffers);
- the IPC handle exchange and peer-access check between processes sharing the GPU, and the
  custom, quantized and fused all-reduce between them inside jit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

from spmd._native_lib import cuda_tables, native_cuda
from spmd.ops._gpu_chain import ALGOS, CODECS

CUSTOM_DTYPE_CODES = cuda_tables()["custom_dtypes"]


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
    # The ranks share the one GPU, with each other and with this process (where a test of the
    # chain may have started JAX on it): none may reserve most of its memory.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env}
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
    # Every NCCL handler with a group of one (NCCL refuses two ranks on one GPU).
    m = x.reshape(64, 64)
    i = jnp.arange(-512, 512, dtype=jnp.int32)
    h = jnp.arange(1024, dtype=jnp.bfloat16)
    calls = {
        "allgather": (lambda: spmd.allgather(m, axis=1), m),
        "allgatherv": (lambda: spmd.allgatherv(m, sizes=[64]), m),
        "reduce_scatter": (lambda: spmd.reduce_scatter(m, axis=1), m),
        "reduce_scatterv": (lambda: spmd.reduce_scatterv(m, sizes=[64]), m),
        "broadcast": (lambda: spmd.broadcast([m, i]), [m, i]),
        "all_to_all": (lambda: spmd.all_to_all(m, split_axis=0, concat_axis=1), m),
        "all_to_allv": (
            lambda: spmd.all_to_allv(m, [64], out_rows=70),
            jnp.concatenate([m, jnp.zeros((6, 64))]),
        ),
        "sendrecv": (lambda: spmd.sendrecv(m, src=0, dst=0), m),
        "allreduce max int32": (lambda: spmd.allreduce(i, op="max"), i),
        "allreduce prod int32": (lambda: spmd.allreduce(i, op="prod"), i),
        "allreduce avg bfloat16": (lambda: spmd.allreduce(h, op="avg"), h),
        "allreduce min bool": (lambda: spmd.allreduce(i > 0, op="min"), i > 0),
    }
    for name, (call, want) in calls.items():
        text = jax.jit(call).lower().as_text()
        assert "spmd_cuda_" in text, name
        for got, w in zip(jax.tree.leaves(jax.jit(call)()), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w), err_msg=name)
    print("ok", spmd.ops.get_transport())
"""


_GRAPHS = "--xla_gpu_enable_command_buffer=CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


@pytest.mark.parametrize(
    "xla_flags", ["--xla_gpu_enable_command_buffer=", _GRAPHS], ids=["no-graphs", "cuda-graphs"]
)
def test_nccl_world_of_one_inside_jit(xla_flags):
    done = _run(_NCCL_WORLD_OF_ONE, {"SPMD_GPU_TRANSPORT": "nccl", "XLA_FLAGS": xla_flags})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok nccl" in done.stdout


_IPC_EXCHANGE = """
    import spmd
    from spmd.ops._primitive import resolve
    from spmd.runtime import find_native_group
    comm = spmd.init()
    ref = resolve()
    group = find_native_group(ref.gid).gpu
    # NCCL refuses two ranks on one GPU; the IPC buffers and the peer-access check must work.
    assert group.custom, group.reason
    assert not group.nccl and "uplicate" in group.nccl_reason, group.nccl_reason
    print("ok", comm.rank, spmd.ops.get_transport())
    spmd.finalize()
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ipc_exchange_between_processes_sharing_the_gpu(nprocs):
    done = _run(_IPC_EXCHANGE, {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0"}, nprocs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == nprocs and "custom" in done.stdout


_TIMELINE = """
    import jax, jax.numpy as jnp, numpy as np, spmd
    comm = spmd.init()
    f = jax.jit(lambda x: spmd.allreduce(x * 2.0))
    for i in range(3):
        y = f(jnp.full(1024 * (i + 1), comm.rank + 1.0))
        np.testing.assert_array_equal(np.asarray(y), 2.0 * 3)  # (1 + 2) * 2 on 2 ranks
    print("ok", comm.rank, spmd.ops.get_transport())
"""


def test_gpu_calls_are_on_the_timeline_with_the_gpus_own_times(tmp_path):
    """SPMD_TIMELINE between 2 processes sharing the GPU: each GPU collective is on its rank's
    track, transport "gpu", timed by the GPU's own pair of CUDA events (state "done"), in call
    order, with its bytes."""
    import json

    timeline = tmp_path / "timeline"
    env = {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0", "SPMD_TIMELINE": str(timeline)}
    done = _run(_TIMELINE, env, 2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == 2
    events = json.loads((timeline / "timeline.json").read_text())["traceEvents"]
    for rank in (0, 1):
        calls = sorted((e for e in events if e["ph"] == "X" and e["pid"] == rank
                        and e["args"].get("transport") == "gpu"),
                       key=lambda e: e["args"]["call"])  # fmt: skip
        assert [e["name"] for e in calls] == ["allreduce"] * 3, calls
        assert [e["args"]["bytes"] for e in calls] == [4096, 8192, 12288], calls
        assert all(e["args"]["state"] == "done" and e["dur"] >= 0 for e in calls), calls
        starts = [e["ts"] for e in calls]
        assert starts == sorted(starts)


_CUSTOM_BETWEEN_PROCESSES = """
    import functools, re
    import jax, jax.numpy as jnp, ml_dtypes, numpy as np, spmd
    from spmd._native_lib import native
    from spmd.ops import _gpu_chain
    comm = spmd.init()
    n, r = comm.size, comm.rank

    def inputs(shape, dtype, seed):  # every rank's input, known to every rank
        return [np.random.default_rng(seed * 16 + k).standard_normal(shape).astype(dtype)
                for k in range(n)]

    def rank_order(xs):
        acc = xs[0].astype(np.float32)
        for x in xs[1:]:
            acc = acc + x.astype(np.float32)
        return acc

    def algo(f, *args):  # the chain's choice, as compiled into the program
        found = re.search(r"algos\\s*=\\s*array<i64:\\s*(\\d+)", f.lower(*args).as_text())
        return int(found.group(1))

    bf16 = ml_dtypes.bfloat16
    cases = [(4096, np.float32, "one_shot"), (4 << 20, np.float32, "two_shot"),
             (64 << 10, bf16, "one_shot"), (3 << 20, bf16, "two_shot")]
    for count, dtype, want in cases:
        xs = inputs(count, dtype, count)
        f = jax.jit(spmd.allreduce)
        assert algo(f, xs[r]) == _gpu_chain.ALGOS[want], (count, dtype, want)
        for _ in range(3):  # the barrier counters carry over between calls
            y = np.asarray(f(jnp.asarray(xs[r])))
            np.testing.assert_array_equal(y, rank_order(xs).astype(dtype))

    # A fused call with leaves only NCCL took before packing (sizes not a multiple of 16 bytes;
    # NCCL is down here): the small leaves go as one padded buffer per dtype.
    shapes = {"a": ((3, 5), np.float32), "b": ((1000,), np.float32), "c": ((7,), bf16),
              "d": ((2, 4), bf16), "e": ((1 << 18,), np.float32)}
    every = {k: inputs(s, t, 7 + i) for i, (k, (s, t)) in enumerate(shapes.items())}
    mine = {k: jnp.asarray(v[r]) for k, v in every.items()}
    f = jax.jit(spmd.allreduce)
    text = f.lower(mine).as_text()
    assert text.count("@spmd_cuda_allreduce") == 1, text
    packs = re.search(r"algos\\s*=\\s*array<i64:([\\d, ]+)>", text).group(1).split(",")
    assert len(packs) == 3, text  # float32 a+b, bfloat16 c+d, e alone
    for _ in range(3):
        got = f(mine)
        for k, v in every.items():
            np.testing.assert_array_equal(np.asarray(got[k]), rank_order(v).astype(v[0].dtype),
                                          err_msg=k)

    for codec in _gpu_chain.CODECS:
        xs = inputs(1 << 20, np.float32, 5)  # 4 MiB: above quantize_min at 2 and 4 ranks
        f = jax.jit(functools.partial(spmd.allreduce, quantize=codec))
        assert algo(f, xs[r]) == _gpu_chain.ALGOS["quantized"], codec
        code = _gpu_chain.CODECS[codec]
        ref = native().quant_allreduce_reference(code, n, np.stack(xs).tobytes())
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(xs[r]))),
                                      np.frombuffer(ref, np.float32))

    for rows in (8, 512):  # 64 KiB: fused one-shot; 4 MiB: fused two-shot
        xs = inputs((rows, 4096), bf16, rows)
        res = inputs((rows, 4096), bf16, rows + 1)[r]
        w = np.random.default_rng(r).uniform(0.5, 1.5, 4096).astype(bf16)
        normed, res_out = jax.jit(spmd.ops.allreduce_rmsnorm)(xs[r], res, w)
        out = (rank_order(xs).astype(bf16).astype(np.float32) + res.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(res_out), out.astype(bf16))
        o32 = out.astype(bf16).astype(np.float32)
        want = o32 / np.sqrt(np.mean(o32 * o32, -1, keepdims=True) + 1e-6) * w.astype(np.float32)
        np.testing.assert_allclose(np.asarray(normed).astype(np.float32), want, rtol=2e-2,
                                   atol=2e-2)
    print("ok", r, flush=True)
    spmd.finalize()
"""


@pytest.mark.parametrize(
    "nprocs,xla_flags",
    [(2, ""), (4, ""), (2, _GRAPHS)],
    ids=["2-ranks", "4-ranks", "2-ranks-cuda-graphs"],
)
def test_custom_allreduce_between_processes_sharing_the_gpu(nprocs, xla_flags):
    """The custom all-reduce, quantized all-reduce and fused RMSNorm inside jit between real
    processes: one-shot and two-shot, chosen by the chain, bit-identical to the rank-order sum,
    also when XLA replays them from CUDA graphs (the barriers count their epochs on the device).
    The processes share one GPU, so their kernels take turns (slow, but the barriers hold)."""
    env = {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0", "SPMD_TIMEOUT": "120"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    done = _run(_CUSTOM_BETWEEN_PROCESSES, env, nprocs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == nprocs


def test_more_processes_than_gpus_is_a_clear_error():
    from spmd.runtime._device import _cuda_device_count

    if (_cuda_device_count() or 0) != 1:
        pytest.skip("needs a machine with exactly one GPU")
    done = _run("import spmd; spmd.init(); print('started')", {}, 2)
    assert done.returncode != 0 and "started" not in done.stdout, done.stdout
    assert "2 processes run on the node of rank 0, which has 1 GPU(s)" in done.stdout + done.stderr


_DATA_PARALLEL = """
    import jax, jax.numpy as jnp, numpy as np, optax, spmd
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: compare to 1e-5
    comm = spmd.init()
    n, r = comm.size, comm.rank
    k = jax.random.split(jax.random.key(0), 4)
    # Leaves of 33 and 5 floats: sizes the custom kernel takes only packed (NCCL is down here).
    params = {"w1": jax.random.normal(k[0], (13, 33)) * 0.3, "b1": jnp.zeros(33),
              "w2": jax.random.normal(k[1], (33, 5)) * 0.3, "b2": jnp.zeros(5)}
    x = jax.random.normal(k[2], (8 * n, 13))
    y = jax.random.randint(k[3], (8 * n,), 0, 5)
    mine = slice(8 * r, 8 * (r + 1))

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()

    tx = optax.sgd(0.1, momentum=0.9)

    @spmd.data_parallel
    def step(p, s, x, y):
        value, g = spmd.value_and_grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    @jax.jit
    def one_process(p, s, x, y):  # the whole batch in one process
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    assert "allreduce" in str(spmd.trace(step)(params, tx.init(params), x[mine], y[mine]))
    p, s = params, tx.init(params)
    q, t = params, tx.init(params)
    for _ in range(5):
        p, s, _ = step(p, s, x[mine], y[mine])
        q, t = one_process(q, t, x, y)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        everyone = comm.allgather_object(b"".join(np.asarray(a).tobytes()
                                                  for a in jax.tree.leaves(p)))
        assert len(set(everyone)) == 1  # bit-identical on every rank
    print("ok", r, flush=True)
    spmd.finalize()
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_data_parallel_between_processes_sharing_the_gpu(nprocs):
    """@data_parallel on the GPU through the custom all-reduce: five SGD steps equal one process
    training on the global batch, bit-identical across ranks."""
    env = {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0", "SPMD_TIMEOUT": "120"}
    done = _run(_DATA_PARALLEL, env, nprocs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == nprocs


_MISMATCH = """
    import os
    import jax, jax.numpy as jnp, numpy as np, spmd
    comm = spmd.init()
    r = comm.rank
    debug = os.environ.get("SPMD_DEBUG") == "1"
    graphs = "command_buffer" in os.environ.get("XLA_FLAGS", "")

    def fails(f, x, *needles):
        try:
            jax.block_until_ready(f(x))
        except Exception as e:  # JaxRuntimeError inside jit
            text = str(e)
            assert f"rank {r}: allreduce" in text, text  # names this rank and the op
            for needle in needles:
                assert needle in text, (needle, text)
            return
        raise AssertionError(f"rank {r}: no error")

    x = jnp.ones(4096, jnp.float32)
    # sum on one rank, avg on the other: the same native call, another meaning.
    op = "sum" if r == 0 else "avg"
    fails(jax.jit(lambda x: spmd.allreduce(x, op=op)), x,
          "made different collective calls", "rank 0: allreduce(op=sum) of float32[4096]",
          "rank 1: allreduce(op=avg) of float32[4096]")
    # Other shapes: compared before a kernel runs, so no rank reads past a peer's buffer.
    fails(jax.jit(spmd.allreduce), x[: 4096 - 1024 * r],
          "rank 1: allreduce(op=sum) of float32[3072]")
    # The fused all-reduce + RMSNorm with another eps.
    h = jnp.ones((8, 4096), jnp.bfloat16)
    fails(jax.jit(lambda h: spmd.ops.allreduce_rmsnorm(h, h, h[0], eps=1e-6 * (1 + r))), h,
          "allreduce_rmsnorm(eps=1e-06)", "allreduce_rmsnorm(eps=2e-06)")
    # The group still works, and a call site that ran once runs again without a comparison.
    f = jax.jit(lambda x: spmd.allreduce(x * (r + 1)))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), np.full(4096, 3.0, np.float32))
    if debug:  # every call is compared: a rank running another program fails at once
        g = jax.jit(lambda x: spmd.allreduce(x[:2048]))
        fails(f if r == 0 else g, x, "rank 0: allreduce(op=sum) of float32[4096]",
              "rank 1: allreduce(op=sum) of float32[2048]")
    # The flight recorder holds the GPU calls, recorded as enqueued (or failed), unless
    # replayed from a CUDA graph (XLA runs a program's first executions uncaptured).
    from spmd.runtime import _recorder
    recs = _recorder.records()
    gpu = recs[recs["transport"] == -2]
    assert len(gpu) >= (1 if graphs else 3), recs
    assert set(gpu["state"].tolist()) <= {2, 3}, gpu
    print("ok", r, flush=True)
    spmd.finalize()
"""


_SEQUENCE = """
    import time
    import jax, jax.numpy as jnp, spmd
    comm = spmd.init()
    r = comm.rank
    x = jnp.ones(4096, jnp.float32)
    fa = jax.jit(lambda x: spmd.allreduce(x, op="sum"))
    fb = jax.jit(lambda x: spmd.allreduce(x, op="avg"))
    for g in (fa, fb, fa, fb):  # the first runs, compared in full, then the sequence check
        jax.block_until_ready(g(x))
    print("started", r, time.time(), flush=True)
    for g in ((fa, fb) if r == 0 else (fb, fa)) * 2:
        jax.block_until_ready(g(x))
    print("not found", r, flush=True)
"""


def test_gpu_calls_in_another_order_after_their_first_runs_are_found():
    """After each call site's first run, the GPU handlers' calls go through the sequence check
    (every call with SPMD_CUDA_GRAPHS=0), which never waits: two call sites in another order on
    one rank fail the rank that finds it (by its second call at the latest) naming both calls,
    and spmd-run ends the job, the peer's kernel waiting for the call that never came
    included."""
    # Every call counts only where XLA may not capture the handlers in CUDA graphs.
    env = {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0", "SPMD_TIMEOUT": "60",
           "SPMD_CUDA_GRAPHS": "0"}  # fmt: skip
    start = time.monotonic()
    done = _run(_SEQUENCE, env, 2)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "not found" not in out, out
    assert out.count("started") == 2, out
    assert "found by the sequence check" in out, out
    assert "rank 0: allreduce(op=sum) of float32[4096]" in out, out
    assert "rank 1: allreduce(op=avg) of float32[4096]" in out, out
    assert took < 45, f"the job took {took:.0f} s to end"


@pytest.mark.parametrize(
    "debug,xla_flags",
    [("0", ""), ("1", ""), ("0", _GRAPHS)],
    ids=["first-runs", "every-call", "first-runs-cuda-graphs"],
)
def test_gpu_calls_that_differ_between_ranks_fail_on_every_rank(debug, xla_flags):
    """The GPU handlers compare each call site's first run across the ranks (every call under
    SPMD_DEBUG=1) on the group's CPU transport: a different op, shape or parameter is a
    mismatch error on every rank naming each rank's call, before any kernel runs."""
    env = {"SPMD_CUSTOM_AR": "force", "SPMD_BIND_DEVICE": "0", "SPMD_TIMEOUT": "60",
           "SPMD_DEBUG": debug}  # fmt: skip
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    done = _run(_MISMATCH, env, 2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok") == 2
