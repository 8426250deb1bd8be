"""spmd: JAX-style SPMD distributed training, one process per device.

Importing spmd starts nothing: no MPI, no JAX backend. :func:`spmd.init` does.
"""

from ._errors import SpmdError as SpmdError
from ._errors import SpmdTypeError as SpmdTypeError
from ._version import __version__ as __version__
from .mesh import Mesh as Mesh
from .mesh import current_mesh as current_mesh
from .runtime import Communicator as Communicator
from .runtime import finalize as finalize
from .runtime import get_communicator as get_communicator
from .runtime import init as init
from .runtime import is_initialized as is_initialized
from .runtime import set_default_communicator as set_default_communicator

__all__ = [
    "Communicator",
    "Mesh",
    "SpmdError",
    "SpmdTypeError",
    "__version__",
    "current_mesh",
    "finalize",
    "get_communicator",
    "init",
    "is_initialized",
    "set_default_communicator",
]
