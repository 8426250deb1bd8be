"""Loading spmd's native layer (``spmd._native``) and checking it matches this Python code."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from ._errors import SpmdError

# Must equal SPMD_NATIVE_ABI_VERSION in native/include/spmd/common.h.
NATIVE_ABI_VERSION = 8


@functools.cache
def native() -> ModuleType:
    """The compiled ``spmd._native`` module; a clear error if it is missing or stale."""
    try:
        _native = importlib.import_module(f"{__package__}._native")
    except ImportError as e:
        raise SpmdError(
            f"spmd's native module is missing ({e}); spmd must be installed with pip, which "
            "compiles native/ (pip install .), not used from a source checkout"
        ) from None
    if _native.abi_version() != NATIVE_ABI_VERSION:
        raise SpmdError(
            f"spmd's native module has ABI version {_native.abi_version()}, this Python code "
            f"expects {NATIVE_ABI_VERSION}: reinstall spmd (pip install .) to rebuild it"
        )
    return _native
