"""3D parallel training of a small language model: pipeline, tensor, context and data parallel
on one mesh.

    spmd-run -n 8 python examples/train_lm.py --mesh pp=2,dp=2,tp=2
    spmd-run -n 4 python examples/train_lm.py --mesh pp=2,tp=2 --schedule gpipe
    spmd-run -n 2 python examples/train_lm.py --mesh dp=2 --zero 2
    spmd-run -n 2 python examples/train_lm.py --mesh cp=2
    spmd-run -n 2 python examples/train_lm.py --mesh auto   # the layout spmd.perf.plan picks
    python examples/train_lm.py                  # one process: the same model, the same batches

A decoder-only transformer reads bytes (a vocabulary of 256) of the Python standard library's
own source, found next to the running interpreter, and learns to continue it. The mesh splits
the work four ways:

- ``pp``: the transformer blocks, stacked on a leading axis, are split into consecutive stages
  (``spmd.pipeline_value_and_grad``, ``--schedule`` gpipe, 1f1b or zero_bubble over
  ``--microbatches``); the
  first stage also embeds the bytes, the last also applies the head and the loss;
- ``tp``: inside a block, attention heads and MLP columns are split (Megatron-LM's layers from
  ``spmd.tensor_parallel``), and so are the embedding and the head over the vocabulary;
- ``cp``: each rank takes its part of every sequence (``spmd.context_parallel``'s
  load-balanced causal split), and attention runs as ring attention over the cp ranks;
- ``dp``: each replica of the pipeline takes its rows of the global batch, and
  ``@spmd.data_parallel`` (or ``@spmd.zero_shard`` with ``--zero 1|2``) averages the gradients
  over dp and cp (the ranks that see different tokens).

Every rank builds the full parameters from one seed and keeps its blocks (ShardedArrays), draws
the same global batch and takes its rows, so a run on any mesh follows the one-process run step
for step (up to rounding; ``--check`` prints the losses with every digit). The embedding and the
head are held by every stage but used by the first and the last: the pipeline sums their
gradients over ``pp`` (its ``shared=``) so that every stage applies the same update.

At the end rank 0 saves a loss curve (``--plot``), the checkpoint is written (``--save``;
``--resume`` continues from one, on any mesh), and the model, gathered into rank 0, writes a
continuation of a prompt.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spmd

P = spmd.PartitionSpec
tp = spmd.tensor_parallel
VOCAB = 256
SHARED = ("embed", "pos", "lnf", "head")  # held by every stage, used by the first or the last


# -- data -----------------------------------------------------------------------------------------


def corpus(limit: int) -> np.ndarray:
    """Up to ``limit`` bytes of the standard library's top-level modules, in name order."""
    where = Path(os.__file__).parent
    out, size = [], 0
    for path in sorted(where.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"".join(out)[:limit], np.uint8).astype(np.int32)


def batch(text: np.ndarray, step: int, rows: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of step ``step``: the same on every rank and every mesh."""
    starts = np.random.default_rng(step).integers(0, len(text) - seq - 1, rows)
    window = text[starts[:, None] + np.arange(seq + 1)]
    return window[:, :-1], window[:, 1:]


# -- the model ------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))  # one program, not one per leaf
def init_params(key: jax.Array, layers: int, d: int, hidden: int, seq: int) -> Any:
    k = iter(jax.random.split(key, 12))

    def dense(*shape: int) -> jax.Array:
        return jax.random.normal(next(k), shape) / np.sqrt(shape[-2])

    return {
        "embed": jax.random.normal(next(k), (VOCAB, d)) * 0.02,
        "pos": jax.random.normal(next(k), (seq, d)) * 0.02,
        "blocks": {
            "ln1": jnp.ones((layers, d)), "ln2": jnp.ones((layers, d)),
            "wq": dense(layers, d, d), "wk": dense(layers, d, d), "wv": dense(layers, d, d),
            "wo": dense(layers, d, d) / np.sqrt(2 * layers),
            "w1": dense(layers, d, hidden), "b1": jnp.zeros((layers, hidden)),
            "w2": dense(layers, hidden, d) / np.sqrt(2 * layers), "b2": jnp.zeros((layers, d)),
        },
        "lnf": jnp.ones(d),
        "head": dense(d, VOCAB),
    }  # fmt: skip


# How each parameter is split: blocks over pp (their leading axis), heads and MLP columns over
# tp, the embedding and the head over the vocabulary (tp); the rest is replicated.
SPECS = {
    "embed": P("tp", None), "pos": None, "lnf": None, "head": P(None, "tp"),
    "blocks": {
        "ln1": P("pp", None), "ln2": P("pp", None),
        "wq": P("pp", None, "tp"), "wk": P("pp", None, "tp"), "wv": P("pp", None, "tp"),
        "wo": P("pp", "tp", None),
        "w1": P("pp", None, "tp"), "b1": P("pp", "tp"), "w2": P("pp", "tp", None),
        "b2": P("pp", None),
    },
}  # fmt: skip


def norm(x: jax.Array, g: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * g


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Causal attention of this rank's part of the sequence over all of it (the cp ranks')."""

    def split(t: jax.Array) -> jax.Array:  # (B, S, h * hd) -> (B, S, h, hd)
        return t.reshape(*t.shape[:2], heads, -1)

    o = spmd.context_parallel.attention(split(q), split(k), split(v), causal=True)
    return o.reshape(*o.shape[:2], -1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Causal attention over the whole sequence in one process (for sampling)."""

    def split(t: jax.Array) -> jax.Array:  # (B, S, h * hd) -> (B, h, S, hd)
        return t.reshape(*t.shape[:2], heads, -1).transpose(0, 2, 1, 3)

    q, k, v = split(q), split(k), split(v)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((s.shape[-1], s.shape[-1]), bool))
    o = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1) @ v
    return o.transpose(0, 2, 1, 3).reshape(*o.shape[:1], o.shape[2], -1)


def block(b: Any, h: jax.Array, heads: int) -> jax.Array:
    """One transformer block on this rank's tensor-parallel blocks ``b`` (plain arrays)."""
    x = norm(h, b["ln1"])
    q, k, v = (tp.column_linear(x, b[w]) for w in ("wq", "wk", "wv"))
    h = h + tp.row_linear(ring_attention(q, k, v, heads), b["wo"])
    x = norm(h, b["ln2"])
    return h + tp.row_linear(jax.nn.gelu(tp.column_linear(x, b["w1"], b["b1"])), b["w2"], b["b2"])


def make_stage(heads: int, first: bool, last: bool, unrolled: bool = False) -> Any:
    """This rank's pipeline stage: (its parameters, what the previous stage sent) -> what it
    sends on (the first stage takes the bytes, the last returns its block of the logits).
    ``unrolled``: the blocks one after the other instead of a ``lax.scan`` (for the zero-bubble
    schedule, which splits the backward pass equation by equation: a scan's is one)."""
    local_heads = heads // spmd.current_mesh().shape["tp"]

    def stage(p: Any, x: jax.Array) -> jax.Array:
        p = tp.local(p)  # this rank's blocks, as plain arrays
        if first:  # the positions of this rank's tokens in the whole sequence (cp)
            where = spmd.context_parallel.positions(x.shape[1], causal=True)
            h = tp.vocab_embed(x, p["embed"]) + p["pos"][where]
        else:
            h = x
        if unrolled:
            for i in range(jax.tree_util.tree_leaves(p["blocks"])[0].shape[0]):
                h = block(jax.tree_util.tree_map(lambda a, i=i: a[i], p["blocks"]), h, local_heads)
        else:
            h, _ = jax.lax.scan(lambda h, b: (block(b, h, local_heads), None), h, p["blocks"])
        return tp.column_linear(norm(h, p["lnf"]), p["head"]) if last else h

    return stage


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return tp.vocab_cross_entropy(logits, targets).mean()


def dense_logits(p: Any, ids: jax.Array, heads: int) -> jax.Array:
    """The whole model in one process, on full parameters (no spmd): for sampling."""
    h = p["embed"][ids] + p["pos"][: ids.shape[1]]
    for i in range(p["blocks"]["wq"].shape[0]):
        b = jax.tree_util.tree_map(lambda a, i=i: a[i], p["blocks"])
        x = norm(h, b["ln1"])
        h = h + attention(x @ b["wq"], x @ b["wk"], x @ b["wv"], heads) @ b["wo"]
        x = norm(h, b["ln2"])
        h = h + jax.nn.gelu(x @ b["w1"] + b["b1"]) @ b["w2"] + b["b2"]
    return norm(h, p["lnf"]) @ p["head"]


def sample(p: Any, prompt: bytes, n: int, seq: int, heads: int, temperature: float) -> bytes:
    """``n`` bytes after ``prompt``, each drawn from the model's distribution given the
    ``seq`` bytes before it (newlines before the prompt fill the first windows)."""
    logits_of = jax.jit(lambda p, ids: dense_logits(p, ids, heads)[0, -1])
    ids = [10] * seq + list(prompt)
    key = jax.random.key(1)
    for _ in range(n):
        window = jnp.asarray([ids[-seq:]])
        key, sub = jax.random.split(key)
        ids.append(int(jax.random.categorical(sub, logits_of(p, window) / temperature)))
    return bytes(ids[seq:])


# -- training -------------------------------------------------------------------------------------


def parse_mesh(text: str, ap: argparse.ArgumentParser) -> dict[str, int]:
    axes = {"pp": 1, "dp": 1, "cp": 1, "tp": 1}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in axes or not size.isdigit():
            ap.error(f"--mesh: {part!r}; use pp=N, dp=N, cp=N and tp=N")
        axes[name] = int(size)
    return axes


def choose_layout(args: argparse.Namespace, world: int, say: Any) -> dict[str, int]:
    """--mesh auto: rank the layouts of this model on ``world`` ranks by predicted step time,
    print the first ``--plans``, and take the first (its mesh, schedule, microbatches, ZeRO)."""
    model = spmd.perf.Model(layers=args.layers, hidden=args.dim, heads=args.heads, seq=args.seq,
                            batch=args.batch, vocab=VOCAB)  # fmt: skip
    # The microbatch counts benchmarks/plan.py measured the planner against.
    ranked = spmd.perf.plan(model, world=world, cost=args.cost, microbatches=(1, 2, 4))
    say(f"--mesh auto: {len(ranked)} layouts of {world} ranks, fastest predicted first (the "
        "first's schedule, microbatches and ZeRO stage replace the command line's):")  # fmt: skip
    for i, p in enumerate(ranked[: args.plans], 1):
        say(f"  {i}. {p.layout.describe():<28} {p.time * 1e3:8.1f} ms/step  "
            f"{p.memory / 2**20:7.1f} MiB/rank")  # fmt: skip
    best = ranked[0].layout
    args.schedule, args.microbatches, args.zero = best.schedule, best.microbatches, best.zero
    return best.axes


def progress(i: int, total: int, loss: float, tokens_per_s: float) -> None:
    done = int(30 * i / total)
    line = f"[{'#' * done}{'.' * (30 - done)}] step {i}/{total}  loss {loss:.4f}"
    print(f"\r{line}  {tokens_per_s:,.0f} tokens/s", end="" if i < total else "\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="", help="axis sizes, e.g. pp=2,dp=2,cp=2,tp=2 (default 1), "
                    "or auto: the layout spmd.perf.plan predicts fastest (its schedule, "
                    "microbatches and ZeRO stage replace --schedule, --microbatches and "
                    "--zero)")  # fmt: skip
    ap.add_argument("--cost", help="with --mesh auto: a fitted cost model (benchmarks/plan.py's "
                    "JSON); default: the planner's reference fit")  # fmt: skip
    # One stage per rank here (the interleaved schedule's chunks would each need their roles).
    one_chunk = [s for s in spmd.pipeline.SCHEDULES if s != "interleaved"]
    ap.add_argument("--schedule", choices=one_chunk, default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp")
    ap.add_argument("--plans", type=int, default=5, help="with --mesh auto: layouts to print")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--check", action="store_true", help="print every step's loss, all digits")
    ap.add_argument("--save", help="write a checkpoint here at the end")
    ap.add_argument("--resume", help="continue from this checkpoint (any mesh)")
    ap.add_argument("--plot", help="save the loss curve to this PNG")
    ap.add_argument("--sample", type=int, default=200, help="bytes to write at the end")
    args = ap.parse_args()

    comm = spmd.get_communicator()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    auto = args.mesh == "auto"
    axes = choose_layout(args, comm.size, say) if auto else parse_mesh(args.mesh, ap)
    mesh = spmd.Mesh(**axes)
    if (args.layers % axes["pp"] or args.heads % axes["tp"] or args.batch % axes["dp"]
            or args.seq % (2 * axes["cp"])):  # fmt: skip
        ap.error(f"--mesh {args.mesh}: pp must divide --layers {args.layers}, tp --heads "
                 f"{args.heads}, dp --batch {args.batch}, 2 * cp --seq {args.seq}")  # fmt: skip
    text = corpus(args.corpus_bytes)
    say(f"{comm.size} ranks, mesh {dict(mesh.shape)}, {len(text):,} bytes of the standard library"
        f" ({Path(os.__file__).parent.name}), schedule {args.schedule}, "
        f"{args.microbatches} microbatches, ZeRO {args.zero or 'off'}")  # fmt: skip
    tx = optax.adam(args.lr)

    with mesh:
        c = mesh.coords()
        first, last = c["pp"] == 0, c["pp"] == axes["pp"] - 1
        rows = args.batch // axes["dp"]
        pipe = spmd.pipeline_value_and_grad(
            make_stage(args.heads, first, last, args.schedule == "zero_bubble"), lm_loss,
            microbatches=args.microbatches, schedule=args.schedule,
            shared={k: k in SHARED for k in SPECS},
        )  # fmt: skip

        def update(p: Any, state: Any, ids: jax.Array, targets: jax.Array) -> Any:
            loss, g = pipe(p, ids, targets)
            updates, state = tx.update(g, state, p)
            loss = spmd.allreduce(loss, "avg", group=("dp", "cp"))
            return optax.apply_updates(p, updates), state, loss

        full = init_params(jax.random.key(0), args.layers, args.dim, 4 * args.dim, args.seq)
        params = tp.shard_params(full, SPECS)
        state = tx.init(params)
        start = 0
        if args.resume:
            loaded = spmd.load(args.resume, like={"params": params, "opt": state})
            params, state = loaded["params"], loaded["opt"]
            start = int(spmd.checkpoint.metadata(args.resume)["step"])
            say(f"resumed from {args.resume} at step {start}")
        if args.zero:
            step = spmd.zero_shard(update, stage=args.zero, group=("dp", "cp"))
            blocks, zstate = step.shard(tp.local(params), tx.init(tp.local(params)))
        else:
            step = spmd.data_parallel(update, group=("dp", "cp"))

        losses: list[float] = []
        t0, tokens = time.perf_counter(), 0
        took: list[float] = []  # seconds per step, from the second (the first compiles)
        tick = t0
        for i in range(start + 1, args.steps + 1):
            ids, targets = batch(text, i, args.batch, args.seq)
            mine = slice(c["dp"] * rows, (c["dp"] + 1) * rows)
            ids, targets = spmd.context_parallel.split_sequence((ids[mine], targets[mine]),
                                                                causal=True)  # fmt: skip
            if args.zero:
                blocks, zstate, loss = step(blocks, zstate, ids, targets)
            else:
                params, state, loss = step(params, state, ids, targets)
            losses.append(float(loss))
            if i > start + 1:
                took.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            if i == start + 1:  # the first step compiles: count from the second
                t0 = time.perf_counter()
            else:
                tokens += args.batch * args.seq
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            if args.check:
                say(f"step {i} loss {losses[-1]!r}", flush=True)
            elif comm.rank == 0 and sys.stdout.isatty():
                progress(i - start, args.steps - start, losses[-1], rate)
            elif i % 20 == 0 or i == args.steps:
                say(f"step {i:4d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s", flush=True)
        if took:
            say(f"median step {1e3 * float(np.median(took)):.2f} ms over {len(took)} steps")
        if args.zero:  # back to ShardedArrays over pp and tp (the optimizer state stays behind)
            params = jax.tree_util.tree_map(
                lambda s, b: spmd.ShardedArray(b, s.shape, s.spec, s.mesh), params,
                spmd.gather(blocks), is_leaf=spmd.sharded.is_sharded,
            )  # fmt: skip

        if args.save:
            tree = {"params": params} if args.zero else {"params": params, "opt": state}
            spmd.save(args.save, tree, metadata={"step": args.steps})
            say(f"checkpoint: {args.save} (step {args.steps}"
                + (", parameters only" if args.zero else "") + ")")  # fmt: skip
        whole = spmd.gather(params)
    if comm.rank == 0:
        if args.plot and losses:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(range(start + 1, start + 1 + len(losses)), losses)
            ax.set(xlabel="step", ylabel="loss (nats per byte)", title=f"mesh {dict(mesh.shape)}")
            fig.tight_layout()
            fig.savefig(args.plot, dpi=100)
            print(f"loss curve: {args.plot}")
        if args.sample:
            out = sample(whole, b"def ", args.sample, args.seq, args.heads, 0.8)
            print("sample:\n" + out.decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
