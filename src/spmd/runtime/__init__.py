"""spmd's runtime: init/finalize, launcher detection, communicators and their pool.

Knows nothing of JAX tracing; imports neither JAX nor MPI until :func:`init` needs them.
"""

from ._communicator import Communicator as Communicator
from ._state import finalize as finalize
from ._state import get_communicator as get_communicator
from ._state import init as init
from ._state import is_initialized as is_initialized
from ._state import set_default_communicator as set_default_communicator
from ._state import this_rank as this_rank

__all__ = [
    "Communicator",
    "finalize",
    "get_communicator",
    "init",
    "is_initialized",
    "set_default_communicator",
    "this_rank",
]
