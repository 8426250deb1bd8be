"""A data-parallel training run that checkpoints every 3 steps and resumes (spmd.elastic), for
tests/cli/test_elastic.py: ``python _elastic_train.py CKPT_DIR OUT.npz KILL_AT [always]``. Rank
1 SIGKILLs itself before step KILL_AT on the first run (on every run with ``always``)."""

import os
import signal
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax

import spmd

comm = spmd.init()
ckpt, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
always = sys.argv[4:] == ["always"]
STEPS, EVERY = 12, 3


def batch(step):
    """The global batch of a step: the same whatever the world size (12 rows: 1-4 ranks)."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((12, 4)).astype(np.float32)
    return x, (x @ np.arange(1.0, 5.0, dtype=np.float32))[:, None]


def loss_fn(p, b):
    x, y = b
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


tx = optax.adam(0.05)


@spmd.data_parallel
def train_step(p, s, b):
    loss, g = spmd.value_and_grad(loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
state, start, _ = spmd.elastic.resume(ckpt, like={"params": params, "opt": tx.init(params)})
params, opt = state["params"], state["opt"]
if spmd.elastic.restart() and comm.rank == 0:
    print(f"resumed at step {start} on {comm.size} ranks at {time.time():.3f}", flush=True)
for step in range(start, STEPS):
    if step == kill_at and comm.rank == 1 and (spmd.elastic.restart() == 0 or always):
        print(f"killed at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    params, opt, loss = train_step(params, opt, spmd.data.shard_batch(batch(step)))
    if (step + 1) % EVERY == 0:
        spmd.elastic.save(ckpt, step + 1, {"params": params, "opt": opt})
if comm.rank == 0:
    np.savez(out, w=np.asarray(params["w"]), b=np.asarray(params["b"]))
