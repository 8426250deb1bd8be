"""MPICH's launcher-exec program for test hosts (see _hosts.py): called as ssh would be,
``[options] HOST COMMAND...``, it runs COMMAND (joined by spaces, as ssh does, for a shell) in
HOST's network namespace, in new UTS, IPC and mount namespaces with HOST as the hostname and a
``/dev/shm`` of its own."""

from __future__ import annotations

import os
import sys

from ._hosts import PREFIX_VAR

# Run by sh: $0 = the host, $1 = the command.
_INSIDE = 'hostname "$0" && mount -t tmpfs -o mode=1777 spmd-shm /dev/shm && exec sh -c "$1"'


def main(argv: list[str]) -> int:
    while argv and argv[0].startswith("-"):
        argv = argv[1:]  # ssh options (MPICH passes -x)
    prefix = os.environ.get(PREFIX_VAR)
    if len(argv) < 2 or not prefix:
        sys.stderr.write(f"usage: {PREFIX_VAR}=PREFIX hostexec [options] HOST COMMAND...\n")
        return 2
    host, command = argv[0], " ".join(argv[1:])
    args = ["ip", "netns", "exec", prefix + host, "unshare", "--uts", "--ipc", "--mount",
            "--propagation", "private", "sh", "-c", _INSIDE, host, command]  # fmt: skip
    os.execvp(args[0], args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
