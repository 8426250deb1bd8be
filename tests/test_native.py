"""The native layer is compiled by pip install and matches the Python code and jaxlib."""

import importlib.util
import re
from pathlib import Path

from spmd._native_lib import NATIVE_ABI_VERSION, native


def test_native_module_is_built_and_matches():
    mod = native()
    assert mod.abi_version() == NATIVE_ABI_VERSION
    header = Path(__file__).parents[1] / "native" / "include" / "spmd" / "common.h"
    if header.exists():  # a source checkout: the header and the Python constant agree
        assert f"#define SPMD_NATIVE_ABI_VERSION {NATIVE_ABI_VERSION}\n" in header.read_text()


def test_built_against_the_installed_jaxlib_ffi_api():
    spec = importlib.util.find_spec("jaxlib")
    c_api = Path(spec.submodule_search_locations[0], "include", "xla", "ffi", "api", "c_api.h")
    text = c_api.read_text()
    major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
    assert native().xla_ffi_api_version() == (major, minor)
