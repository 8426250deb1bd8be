"""Saves a checkpoint from a plain single-process ``python`` (a world of one), for the
killed-writer test of tests/test_checkpoint.py.

    python tests/_checkpoint_writer.py PATH small   # checkpoint A: small, deterministic
    python tests/_checkpoint_writer.py PATH large   # checkpoint B: hundreds of MB
"""

from __future__ import annotations

import sys

import numpy as np

LARGE_ARRAYS, LARGE_ROWS = 8, 12 * 1024 * 1024  # 8 x 48 MB of float32: ~400 MB to write


def small_tree() -> dict[str, object]:
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.array([1, -2, 3], dtype=np.int8),
        "step": 7,
    }


def large_tree() -> dict[str, object]:
    return {"w": [np.full(LARGE_ROWS, i + 0.5, np.float32) for i in range(LARGE_ARRAYS)]}


def main() -> None:
    import spmd
    from spmd.checkpoint import save

    path, which = sys.argv[1], sys.argv[2]
    spmd.init()
    tree = small_tree() if which == "small" else large_tree()
    save(path, tree, metadata={"which": which})
    print("saved", which, flush=True)


if __name__ == "__main__":
    main()
