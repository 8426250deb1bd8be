"""A bootstrap store in a directory: how the "void" communicator's ranks exchange small data.

Each rank publishes a value by writing a file atomically (temporary file + rename) and reads its
peers' values by polling for their files. It moves bootstrap data (node names, handles, ids), not
tensors. Single machine, as RAF's VoidCommunicator.

The directory is the job's own (docs/security.md): another user of the machine must not be able
to plant a value a rank would unpickle, nor a symbolic link a write would follow. It is created
mode 0700; one that exists is used only if it is a directory (not a link) that this user owns
and nobody else can write to. Every file is opened relative to the directory's descriptor,
taken once, without following links: temporary files are created exclusively (mode 0600) and
renamed into place, and a value is read only from a regular file this user owns.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
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
            Path(root).mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                pass  # a peer made it first, or it is not ours: checked below
            self._fd = os.open(
                self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError as e:
            link = " (a symbolic link, which spmd does not follow)" if self.dir.is_symlink() else ""
            raise SpmdError(
                f"cannot create the bootstrap directory {self.dir}{link} "
                f"(SPMD_FILE_STORE_PATH={root!r}): {e}",
                rank=rank,
            ) from None
        st = os.fstat(self._fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(self._fd)
            raise SpmdError(
                f"the bootstrap directory {self.dir} belongs to {_owner(st.st_uid)} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}; spmd uses it only if it belongs to this user "
                f"({_owner(os.geteuid())}) and nobody else can write to it. Another user may "
                "have made it to take over the job: set SPMD_FILE_STORE_PATH to a directory of "
                "your own (e.g. $(mktemp -d)), or a different SPMD_RUN_ID",
                rank=rank,
            )

    def set(self, key: str, value: bytes) -> None:
        tmp = f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self._fd)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, key, src_dir_fd=self._fd, dst_dir_fd=self._fd)

    def delete(self, key: str) -> None:
        try:
            os.unlink(key, dir_fd=self._fd)
        except FileNotFoundError:
            pass

    def _read(self, key: str) -> bytes | None:
        """The value at ``key``: None while there is none; an error if it is not a regular file
        of this user's (nothing of another user's reaches pickle)."""
        try:
            fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symbolic link
            raise SpmdError(f"cannot read {self.dir / key} from the bootstrap store: {e}",
                            rank=self.rank) from None  # fmt: skip
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise SpmdError(
                    f"{self.dir / key} in the bootstrap store is not a file of this user's "
                    f"(owner {_owner(st.st_uid)}); spmd reads nothing another user wrote",
                    rank=self.rank,
                )
            return f.read()

    def _exists(self, key: str) -> bool:
        try:
            os.stat(key, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def wait(
        self,
        keys: Sequence[str],
        what: str,
        owners: Sequence[int],
        on_board: tuple[str, Sequence[int], int, str] | None = None,
    ) -> list[bytes]:
        """The values of ``keys``, once all exist. ``owners[i]`` is the rank that writes keys[i];
        ``on_board``: the wait on the wait board (``wait_until``)."""
        values: list[bytes | None] = [None] * len(keys)

        def all_present() -> bool:
            for i, key in enumerate(keys):
                if values[i] is None:
                    values[i] = self._read(key)
                    if values[i] is None:
                        return False
            return True

        if not wait_until(all_present, self.timeout, on_board):
            # all_present stops at the first missing key: look at every key once more.
            missing = [
                owners[i]
                for i, key in enumerate(keys)
                if values[i] is None and not self._exists(key)
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
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _owner(uid: int) -> str:
    """A user's name and id, as an error names them."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"
