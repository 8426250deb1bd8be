"""A bootstrap store in a directory: how the "void" communicator's ranks exchange small data.

Each rank publishes a value by writing a file atomically (temporary file + rename) and reads its
peers' values by polling for their files. It moves bootstrap data (node names, handles, ids), not
tensors. Single machine, as RAF's VoidCommunicator.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from .._errors import SpmdError
from ._wait import wait_until


def namespace_from_env(env: dict[str, str] | os._Environ[str]) -> str:
    """A directory name shared by the ranks of one run and different for the next run.

    ``SPMD_RUN_ID`` if set; else the torchrun run id and restart count plus the parent process
    id, which the workers of one launcher share and a later launch does not.
    """
    explicit = env.get("SPMD_RUN_ID")
    if explicit:
        return f"spmd-{explicit}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "run")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"spmd-{run_id}-{restart}-{os.getppid()}"


class FileStore:
    """Key -> bytes in ``root/namespace``; ``set`` is atomic, ``wait`` polls with a deadline."""

    def __init__(self, root: str, namespace: str, rank: int, timeout: float) -> None:
        self.dir = Path(root) / namespace
        self.rank = rank
        self.timeout = timeout
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpmdError(
                f"cannot create the bootstrap directory {self.dir} "
                f"(SPMD_FILE_STORE_PATH={root!r}): {e}",
                rank=rank,
            ) from None

    def set(self, key: str, value: bytes) -> None:
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(value)
        os.replace(tmp, self.dir / key)

    def delete(self, key: str) -> None:
        (self.dir / key).unlink(missing_ok=True)

    def wait(self, keys: Sequence[str], what: str, owners: Sequence[int]) -> list[bytes]:
        """The values of ``keys``, once all exist. ``owners[i]`` is the rank that writes keys[i]."""
        values: list[bytes | None] = [None] * len(keys)

        def all_present() -> bool:
            for i, key in enumerate(keys):
                if values[i] is None:
                    try:
                        values[i] = (self.dir / key).read_bytes()
                    except FileNotFoundError:
                        return False
            return True

        if not wait_until(all_present, self.timeout):
            # all_present stops at the first missing key: look at every key once more.
            missing = [
                owners[i]
                for i, key in enumerate(keys)
                if values[i] is None and not (self.dir / key).exists()
            ]
            raise SpmdError(
                f"{what} timed out after {self.timeout:g} s waiting for "
                f"ranks {missing} (store {self.dir}). Every rank of the group must make the "
                "same calls in the same order; raise SPMD_TIMEOUT if they are just slow.",
                rank=self.rank,
            )
        return [v for v in values if v is not None]

    def remove_all(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
