"""spmd.pipeline: the loss and gradients of a model split into 1, 2 and 4 pipeline stages equal
one process running the whole model on the whole batch, for every schedule and m = 1, 2, 4, 8;
the schedules send what GPipe, 1F1B and ZB-H1 send, in their order; pipelines inside
data_parallel and zero_shard over dp, and with tensor-parallel stages, train as one process
does; bad input is a named error on every rank of the pipeline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank

P = spmd.PartitionSpec
tp = spmd.tensor_parallel
WIDTHS = (6, 10, 8, 12, 8, 6, 4)  # six layers of different widths: stages send different shapes
B = 16


def _close(got, want, what, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6,
                               err_msg=what)  # fmt: skip


def _layers(seed=0):
    keys = jax.random.split(jax.random.key(seed), len(WIDTHS) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full((b,), 0.1)}
        for k, a, b in zip(keys, WIDTHS, WIDTHS[1:], strict=False)
    ]


def _data(seed=1, rows=B):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, WIDTHS[0])).astype(np.float32)
    t = rng.standard_normal((rows, WIDTHS[-1])).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(t)


def apply(layers, h):
    for layer in layers:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return h


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def _notes(program):
    """The pipeline's messages in a traced program, in order: (op, note)."""
    out = []
    for line in str(program).splitlines():
        for op in ("spmd.sendrecv", "spmd.send", "spmd.recv"):
            if f"= {op}(" in line:
                out.append((op[5:], line.split("note='")[1].split("'")[0]))
    return out


def _expected_1f1b(p, s, m):
    """Megatron-LM's non-interleaved 1F1B as stage s of p sends and receives, as spmd.trace
    prints it: the steady phase is a loop over j, printed once (past the first stage, but its
    last pair)."""
    first, last = s == 0, s == p - 1
    warm = min(p - s - 1, m)
    ops = []
    for i in range(warm):
        ops += [] if first else [("recv", f"fwd {i}")]
        ops += [] if last else [("send", f"fwd {i}")]
    if warm < m:
        steady = m - warm
        ops += [] if first else [("recv", f"fwd {warm}")]
        if first:  # every steady pair in the loop: the first stage sends no gradient back
            ops += [] if last else [("sendrecv", f"fwd {warm}+j, bwd j")]
        else:
            if steady > 1:
                ops += [] if last else [("sendrecv", f"fwd {warm}+j, bwd j")]
                ops += [("sendrecv", f"bwd j, fwd {warm + 1}+j")]
            ops += [] if last else [("sendrecv", f"fwd {m - 1}, bwd {steady - 1}")]
            ops += [("send", f"bwd {steady - 1}")]
    for j in range(m - warm, m):
        ops += [] if last else [("recv", f"bwd {j}")]
        ops += [] if first else [("send", f"bwd {j}")]
    return ops


def _expected_zb_h1(p, s, m):
    """ZB-H1: 1F1B's order of forward and input-gradient passes; a forward pass followed by a
    backward pass sends its activation and receives the gradient in one sendrecv, the gradient
    goes back with a plain send; the rounds after the first weight gradient are a loop over j."""
    first, last = s == 0, s == p - 1

    def fwd(n, then=None):
        ops = [] if first else [("recv", f"fwd {n}")]
        if last:
            return ops
        pair = ("send", f"fwd {n}") if then is None else ("sendrecv", f"fwd {n}, bwd {then}")
        return [*ops, pair]

    def bwd(n, received=False):
        ops = [] if last or received else [("recv", f"bwd {n}")]
        return ops + ([] if first else [("send", f"bwd {n}")])

    warm = min(p - s - 1, m)
    steady = m - warm
    head = min(s, steady)
    ops = [op for i in range(warm) for op in fwd(i)]
    ops += [op for k in range(head) for op in fwd(warm + k, k) + bwd(k, True)]
    if steady > head:
        ops += fwd(f"{warm + head}+j", f"{head}+j") + bwd(f"{head}+j", True)
    return ops + [op for j in range(steady, m) for op in bwd(j)]


_EXPECTED = {"1f1b": lambda p, s, m: _expected_1f1b(p, s, m),
             "zero_bubble": lambda p, s, m: _expected_zb_h1(p, s, m),
             "gpipe": lambda p, s, m: _expected_gpipe(p, s, m)}  # fmt: skip


def _expected_gpipe(p, s, m):
    """GPipe: a loop over the forward passes, then one over the backward passes."""
    first, last = s == 0, s == p - 1
    ops = [] if first else [("recv", "fwd i")]
    ops += [] if last else [("send", "fwd i"), ("recv", "bwd i")]
    return ops + ([] if first else [("send", "bwd i")])


_ONE_CHUNK = ("gpipe", "1f1b", "zero_bubble")  # the schedules of one chunk per rank


@multirank(nprocs=(1, 2, 4))
def test_matches_one_process(comm):
    layers = _layers()
    x, t = _data()
    want_loss, want = jax.value_and_grad(lambda ls: mse(apply(ls, x), t))(layers)
    p, s = comm.size, comm.rank
    with spmd.Mesh(pp=p):
        mine = spmd.pipeline.stage_layers(layers)
        index = spmd.pipeline.split(list(range(len(layers))), p)[s]
        for schedule in _ONE_CHUNK:
            for m in (1, 2, 4, 8) if p > 1 else (1, 4):  # one stage: the schedules are alike
                what = f"{schedule} m={m} p={p} stage {s}"
                step = spmd.pipeline_value_and_grad(apply, mse, microbatches=m, schedule=schedule)
                loss, grads = jax.jit(step)(mine, x if s == 0 else None, t if s == p - 1 else None)
                _close(loss, want_loss, f"{what} loss")
                assert len(grads) == len(index)
                for k, g in zip(index, grads, strict=True):
                    for name in ("w", "b"):
                        _close(g[name], want[k][name], f"{what} layer {k} {name}")
                program = spmd.trace(step)(mine, x, t)
                expected = _EXPECTED[schedule](p, s, m)
                assert _notes(program) == expected, (what, str(program))
                if p > 1:  # the loss comes from the last stage
                    assert f"group={list(comm.ranks)}, root={p - 1}" in str(program)


def test_the_interleaved_orders_complete_and_keep_megatrons_warm_up():
    """Every rank's order of forward and backward passes, run against the others' (sends at
    once, receives waiting for their message), completes for p = 1..8, v = 1..4, m = 1..16;
    where m is a multiple of p it is Megatron-LM's (warm-up 2 (p - r - 1) + (v - 1) p), and
    each pass of each chunk and microbatch runs once, each forward before its backward."""
    from spmd.model_parallel import _interleaved as il

    for p in range(1, 9):
        for v in range(1, 5):
            for m in range(1, 17):
                extra = il.warm_up(p, v, m)
                assert il._completes(p, v, m, extra), (p, v, m)
                if m % p == 0:
                    assert extra == 0, (p, v, m)
                for r in range(p):
                    ops = il.order(p, v, m, r, extra)
                    assert sorted(ops) == sorted(
                        (k, j, i) for k in "BF" for j in range(v) for i in range(m)
                    ), (p, v, m, r)
                    assert all(ops.index(("F", j, i)) < ops.index(("B", j, i))
                               for j in range(v) for i in range(m)), (p, v, m, r)  # fmt: skip
                    if m % p == 0:
                        warm = min(m * v, 2 * (p - r - 1) + (v - 1) * p)
                        assert [k for k, _, _ in ops[:warm]] == ["F"] * warm
                        assert warm == m * v or ops[warm + 1][0] == "B"
    # Two stages, two chunks each, four microbatches: rank 0 runs four forward passes first.
    assert il.order(2, 2, 4, 0)[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
                                        ("F", 0, 2), ("B", 1, 0)]  # fmt: skip


_DEEP = (6, 10, 8, 12, 8, 6, 9, 5, 4)  # eight layers: 2 chunks on each of 4 stages


@multirank(nprocs=(1, 2, 4))
def test_interleaved_matches_one_process(comm):
    """virtual_stages=2 (and 3 on two stages): each rank holds chunks r and p + r of the
    layers; loss and gradients equal one process for m from 1 to 8 (fewer microbatches than
    stages, and partial last groups of them, included), and the messages name the chunk that
    sent them."""
    keys = jax.random.split(jax.random.key(0), len(_DEEP) - 1)
    layers = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full((b,), 0.1)}
              for k, a, b in zip(keys, _DEEP, _DEEP[1:], strict=False)]  # fmt: skip
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((24, _DEEP[0])), jnp.float32)
    t = jnp.asarray(rng.standard_normal((24, _DEEP[-1])), jnp.float32)
    want_loss, want = jax.value_and_grad(lambda ls: mse(apply(ls, x), t))(layers)
    p, s = comm.size, comm.rank
    with spmd.Mesh(pp=p):
        for v, ms in ((2, (1, 3, 4, 8)), (3, (2, 3))) if p == 2 else ((2, (1, 3, 6, 8)),):
            chunks = spmd.pipeline.split(list(range(len(layers))), v * p)
            mine = spmd.pipeline.stage_layers(layers, virtual_stages=v)
            assert len(mine) == v
            for m in ms if p > 1 else (1, 3):
                what = f"interleaved v={v} m={m} p={p} stage {s}"
                step = spmd.pipeline_value_and_grad(
                    apply, mse, microbatches=m, schedule="interleaved", virtual_stages=v
                )
                loss, grads = jax.jit(step)(mine, x if s == 0 else None,
                                            t if s == p - 1 else None)  # fmt: skip
                _close(loss, want_loss, f"{what} loss")
                assert isinstance(grads, list) and len(grads) == v
                for j in range(v):
                    for k, g in zip(chunks[j * p + s], grads[j], strict=True):
                        for name in ("w", "b"):
                            _close(g[name], want[k][name], f"{what} chunk {j} layer {k} {name}")
            if p > 1:  # chunk c = j p + s receives from chunk c - 1, on the previous rank
                notes = _notes(spmd.trace(step)(mine, x, t))
                first = ("send", "fwd c0 0") if s == 0 else ("recv", f"fwd c{s - 1} 0")
                assert notes[0] == first, notes
                # Per microbatch each chunk receives its input and sends its output forward,
                # and the gradients the other way (the first and last chunks one of each).
                assert len(notes) == 2 * m * (2 * v - (s == 0) - (s == p - 1)), notes


@multirank(nprocs=(2,))
def test_1f1b_keeps_fewer_microbatches(comm):
    """1F1B's stash holds p - s microbatches, GPipe's all m, ZB-H1's p (and the gradients at the
    parameters' uses that its W reads): the compiled step's temporary memory (activations of 4
    layers of 128 x 128 on 256 rows dominate it) shows the difference. Measured: stage 0 289,
    769 and 321 KiB (1F1B, GPipe, ZB-H1), stage 1 193, 897 and 385 KiB."""
    keys = jax.random.split(jax.random.key(0), 4)
    layers = [{"w": jax.random.normal(k, (128, 128)) * 0.05, "b": jnp.zeros(128)} for k in keys]
    x, t = jnp.ones((256, 128)), jnp.zeros((256, 128))
    with spmd.Mesh(pp=2):
        mine = spmd.pipeline.stage_layers(layers)
        temp = {}
        for schedule in _ONE_CHUNK:
            step = spmd.pipeline_value_and_grad(apply, mse, microbatches=8, schedule=schedule)
            compiled = jax.jit(step).lower(mine, x, t).compile()
            temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < 0.6 * temp["gpipe"], temp
    assert temp["zero_bubble"] < 0.6 * temp["gpipe"], temp
    if comm.rank == 1:  # 1F1B's last stage keeps one microbatch, ZB-H1's two
        assert temp["zero_bubble"] > 1.5 * temp["1f1b"], temp


def test_the_backward_split_computes_nothing_twice():
    """ZB-H1's B and W of a two-layer stage: B holds the two input-gradient products, W the two
    weight-gradient ones, and together they are the backward pass's equations, each once; B
    and W give the gradients of jax.vjp."""
    from spmd.model_parallel._backward_split import BackwardSplit

    layers = _layers()[:2]
    x, _ = _data()
    y, vjp = jax.vjp(apply, layers, x)
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    n_params = len(jax.tree_util.tree_leaves(layers))

    def backward(*flat):
        return jax.tree_util.tree_leaves(jax.tree_util.tree_unflatten(tree, flat[:-1])(flat[-1]))

    g = jnp.cos(y)
    split = BackwardSplit(backward, [*leaves, g], range(n_params, n_params + 1))
    dots = lambda eqns: sum(e.primitive.name == "dot_general" for e in eqns)  # noqa: E731
    assert (dots(split._b_eqns), dots(split._w_eqns)) == (2, 2)
    whole = jax.make_jaxpr(backward)(*leaves, g).jaxpr.eqns
    assert len(split._b_eqns) + len(split._w_eqns) == len(whole)
    (dx,), frontier = split.b(*leaves, g)
    dparams = split.w([*leaves, g], frontier)
    want_params, want_x = vjp(g)
    _close(dx, want_x, "input gradient")
    for got, want in zip(dparams, jax.tree_util.tree_leaves(want_params), strict=True):
        _close(got, want, "parameter gradient")


@multirank(nprocs=(2,))
def test_shared_parameters_get_the_summed_gradient(comm):
    """A scale every stage holds but only the last uses, and an input scale only the first uses:
    with shared=, both stages return the one-process gradient for both."""
    layers = _layers()
    x, t = _data()
    full = {"a": jnp.float32(1.5), "z": jnp.float32(0.7), "layers": layers}

    def model(p, h):
        return apply(p["layers"], h * p["a"]) * p["z"]

    want = jax.grad(lambda p: mse(model(p, x), t))(full)
    s = comm.rank
    with spmd.Mesh(pp=2):

        def stage(p, h):
            h = apply(p["layers"], h * p["a"] if s == 0 else h)
            return h * p["z"] if s == 1 else h

        mine = {"a": full["a"], "z": full["z"], "layers": spmd.pipeline.stage_layers(layers)}
        for shared in ({"a": True, "z": True, "layers": False}, None):
            step = spmd.pipeline_value_and_grad(stage, mse, microbatches=2, shared=shared)
            _, g = jax.jit(step)(mine, x, t)
            for k in ("a", "z"):
                if shared is not None:
                    _close(g[k], want[k], f"shared {k}")
                elif (k == "a") == (s == 0):  # without: only the stage that uses it has it
                    _close(g[k], want[k], f"{k} on its stage")
                else:
                    assert float(g[k]) == 0.0
        with pytest.raises(spmd.SpmdError, match="is not a tree of bools"):
            spmd.pipeline_value_and_grad(stage, mse, microbatches=2, shared={"q": True})(mine, x, t)


# -- composition: data_parallel and zero_shard over dp, tensor-parallel stages -------------------


def _train_one_process(tx, params, loss_fn, batches):
    state, out = tx.init(params), []
    for b in batches:
        g = jax.grad(loss_fn)(params, *b)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        out.append(params)
    return out


@multirank(nprocs=(4,))
def test_data_parallel_and_zero_over_dp(comm):
    tx = optax.adam(0.01)
    layers = _layers()
    batches = [_data(seed) for seed in range(5)]
    want = _train_one_process(tx, layers, lambda ls, x, t: mse(apply(ls, x), t), batches)
    mesh = spmd.Mesh(pp=2, dp=2)
    with mesh:
        c = mesh.coords()
        index = spmd.pipeline.split(list(range(len(layers))), 2)[c["pp"]]
        # 1F1B under data_parallel, the zero-bubble schedule under zero_shard(stage=2), the
        # interleaved one (two chunks per stage) under zero_shard(stage=3)
        pipes = {s: spmd.pipeline_value_and_grad(apply, mse, microbatches=4, schedule=s)
                 for s in ("1f1b", "zero_bubble")}  # fmt: skip
        pipes["interleaved"] = spmd.pipeline_value_and_grad(
            apply, mse, microbatches=4, schedule="interleaved",
            virtual_stages=2)  # fmt: skip

        def make_update(schedule):
            def update(params, state, x, t):
                loss, g = pipes[schedule](params, x, t)
                u, state = tx.update(g, state, params)
                return optax.apply_updates(params, u), state, loss

            return update

        update = make_update("1f1b")

        def half(b):  # this dp replica's half of the batch
            return tuple(v[c["dp"] * B // 2 : (c["dp"] + 1) * B // 2] for v in b)

        mine = spmd.pipeline.stage_layers(layers)
        chunked = spmd.pipeline.stage_layers(layers, virtual_stages=2)
        chunks = spmd.pipeline.split(list(range(len(layers))), 4)
        runs = {}
        for name, step, start, held in (
            ("data_parallel", spmd.data_parallel(update, group="dp"), mine, index),
            ("zero_shard(stage=2)", spmd.zero_shard(make_update("zero_bubble"), stage=2,
                                                    group="dp"), mine, index),
            ("zero_shard(stage=3), interleaved", spmd.zero_shard(make_update("interleaved"),
                                                                 stage=3, group="dp"), chunked,
             [*chunks[c["pp"]], *chunks[2 + c["pp"]]]),
        ):  # fmt: skip
            params, state = start, tx.init(start)
            if name != "data_parallel":
                params, state = step.shard(params, state)
            got = []
            for b in batches:
                params, state, _ = step(params, state, *half(b))
                got.append(jax.tree_util.tree_leaves(spmd.gather(params)))
            runs[name] = (got, held)
        for name, (got, held) in runs.items():
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                mine_w = [w[k][key] for k in held for key in ("b", "w")]  # leaves: b before w
                for k, (a, b) in enumerate(zip(g, mine_w, strict=True)):
                    _close(a, b, f"{name} step {i + 1} leaf {k} (layers {held})", 1e-4)
        text = str(spmd.trace(spmd.data_parallel(update, group="dp"))(
            mine, tx.init(mine), *half(batches[0])))  # fmt: skip
        dp_ranks = next(g for g in mesh.rank_lists("dp") if comm.rank in g)
        assert "spmd.allreduce" in text and f"group={dp_ranks}" in text, text


D, F = 8, 16


def _mlp_stage(p, h):
    """A stage of two tensor-parallel MLP blocks (column then row), residual."""
    for blk in p:
        h = h + tp.row_linear(jax.nn.gelu(tp.column_linear(h, blk["w1"], blk["b1"])),
                              blk["w2"], blk["b2"])  # fmt: skip
    return h


def _dense_stage(p, h):
    for blk in p:
        h = h + jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"]
    return h


@multirank(nprocs=(4,))
def test_tensor_parallel_stages(comm):
    tx = optax.sgd(0.05)
    keys = jax.random.split(jax.random.key(4), 16)
    n = jax.random.normal
    blocks = [
        {"w1": n(keys[4 * i], (D, F)) * 0.3, "b1": n(keys[4 * i + 1], (F,)) * 0.1,
         "w2": n(keys[4 * i + 2], (F, D)) * 0.3, "b2": n(keys[4 * i + 3], (D,)) * 0.1}
        for i in range(4)
    ]  # fmt: skip
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((B, D)).astype(np.float32),
                rng.standard_normal((B, D)).astype(np.float32)) for _ in range(5)]  # fmt: skip
    want = _train_one_process(tx, blocks, lambda ps, x, t: mse(_dense_stage(ps, x), t), batches)
    specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": None}
    mesh = spmd.Mesh(pp=2, tp=2)
    with mesh:
        pp = mesh.coords()["pp"]
        mine = [tp.shard_params(b, specs) for b in spmd.pipeline.stage_layers(blocks)]
        for schedule in ("1f1b", "zero_bubble"):  # B and W split around tp's collectives
            pipe = jax.jit(spmd.pipeline_value_and_grad(_mlp_stage, mse, microbatches=2,
                                                        schedule=schedule))  # fmt: skip
            params = mine
            for i, b in enumerate(batches):
                _, g = pipe(params, *b)
                params = jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, params, g)
                for j, blk in enumerate(params):
                    full = spmd.gather(blk)
                    for key in specs:
                        what = f"{schedule} step {i + 1} block {j}"
                        _close(full[key], want[i][2 * pp + j][key], what, 1e-4)
        # Interleaved: one block per chunk, chunks pp and 2 + pp on this stage.
        chunked = [[tp.shard_params(b, specs) for b in chunk]
                   for chunk in spmd.pipeline.stage_layers(blocks, virtual_stages=2)]  # fmt: skip
        pipe = jax.jit(
            spmd.pipeline_value_and_grad(
                _mlp_stage, mse, microbatches=2, schedule="interleaved", virtual_stages=2
            )
        )
        params = chunked
        for i, b in enumerate(batches):
            _, g = pipe(params, *b)
            params = jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, params, g)
            for j, chunk in enumerate(params):
                full = spmd.gather(chunk[0])
                for key in specs:
                    what = f"interleaved step {i + 1} chunk {2 * j + pp}"
                    _close(full[key], want[i][2 * j + pp][key], what, 1e-4)


# -- bad input ----------------------------------------------------------------------------------


@multirank(nprocs=(2,))
def test_errors(comm):
    layers = _layers()
    x, t = _data()
    s = comm.rank
    with spmd.Mesh(pp=2):
        mine = spmd.pipeline.stage_layers(layers)

        def run(stage_fn=apply, loss_fn=mse, m=4, params=mine, inputs=x, targets=t, **kw):
            step = spmd.pipeline_value_and_grad(stage_fn, loss_fn, microbatches=m, **kw)
            return jax.jit(step)(params, inputs, targets)

        def widen(p, h):  # stage 0 sends 3 features more than stage 1 takes
            h = apply(p, h)
            return jnp.concatenate([h, h[:, :3]], axis=1) if s == 0 else h

        cases = [
            # Found on one stage; every rank raises, naming it.
            (lambda: run(m=3), ("rank 0: pipeline_value_and_grad: inputs has shape (16, 6), whose "
                                "axis 0 does not split into microbatches=3", "rank 1: pipeline_"
                                "value_and_grad: targets has shape (16, 4), whose axis 0")[s]),
            (lambda: run(inputs=None), "inputs is None; the first stage needs the batch"),
            (lambda: run(stage_fn=widen), "rank 1: pipeline_value_and_grad: stage 1's stage_fn "
             "cannot take what stage 0 sends, float32[4, 15]"),
            (lambda: run(loss_fn=lambda y, t: (y - t) ** 2),
             "loss_fn returns float32[4, 4]; expected a floating-point scalar"),
            (lambda: run(m=2 + s), "rank 1 passed microbatches=3, schedule='1f1b', but rank 0 "
             "microbatches=2" if s == 0 else "rank 0 passed microbatches=2"),
            (lambda: run(schedule=("1f1b", "gpipe")[s]), "schedule='gpipe'"),
        ]  # fmt: skip
        for make, text in cases:
            with pytest.raises(spmd.SpmdError) as info:
                make()
            assert text in str(info.value), str(info.value)
        # Interleaved: stage_params must be the v chunks, and v the same on every stage.
        inter = {v: spmd.pipeline_value_and_grad(apply, mse, microbatches=2,
                                                 schedule="interleaved", virtual_stages=v)
                 for v in (2, 3)}  # fmt: skip
        with pytest.raises(spmd.SpmdError, match="stage_params is list of 3; with "
                           "virtual_stages=2 it is a list of 2 pytrees"):  # fmt: skip
            inter[2](mine, x, t)
        with pytest.raises(spmd.SpmdError) as info:
            inter[2 + s]([mine[:1]] * (2 + s), x, t)
        theirs = "rank 1 passed microbatches=2, schedule='interleaved', virtual_stages=3"
        mismatch = theirs if s == 0 else "rank 0 passed microbatches=2, schedule='interleaved', "
        assert mismatch in str(info.value), str(info.value)
        # Still in step: a good call after the errors works.
        loss, _ = run()
        assert np.isfinite(float(loss))
    with spmd.Mesh(pp=2, dp=1):  # the pipeline splits its batch itself
        pipe = spmd.pipeline_value_and_grad(apply, mse, microbatches=2)
        step = spmd.data_parallel(lambda p, x, t: pipe(p, x, t)[1], group="dp", accumulate_steps=2)
        with pytest.raises(spmd.SpmdError, match=r"accumulate_steps=2\) around a pipeline"):
            step(spmd.pipeline.stage_layers(layers), x, t)
    for bad, text in ((0, "microbatches=0"), ("2", "microbatches='2'")):
        with pytest.raises(spmd.SpmdError, match=text):
            spmd.pipeline_value_and_grad(apply, mse, microbatches=bad)
    with pytest.raises(spmd.SpmdError, match="schedule='zb'"):
        spmd.pipeline_value_and_grad(apply, mse, microbatches=2, schedule="zb")
    for v, schedule in ((2, "1f1b"), (1, "interleaved"), (0, "interleaved")):
        with pytest.raises(spmd.SpmdError, match=f"virtual_stages={v} with schedule='{schedule}'"):
            spmd.pipeline_value_and_grad(apply, mse, microbatches=2, schedule=schedule,
                                         virtual_stages=v)  # fmt: skip
    with pytest.raises(spmd.SpmdError, match="6 layers do not fill 8 stages"):
        spmd.pipeline.split(layers, 8)
