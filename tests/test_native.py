"""The native layer is compiled by pip install and matches the Python code and jaxlib."""

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_a_transport_must_be_attached_and_chosen_before_a_collective():
    """The native group refuses a transport it lacks, and a collective on a group whose transport
    was never chosen fails with a clear error instead of crashing (one process, no MPI)."""
    mod = native()
    gid = 1 << 40  # far above the ids the Python group layer hands out
    mod.group_create(gid, 0, 2, [0, 1], 5.0, 64 << 10)
    try:
        for code in (0, 1, 2):  # nothing is attached to this group
            with pytest.raises(RuntimeError, match="is not attached to the group"):
                mod.group_set_transport(gid, code)
        with pytest.raises(
            ValueError, match=r"transport must be 0 \(shm\), 1 \(mpi\) or 2 \(hier\)"
        ):
            mod.group_set_transport(gid, 3)
        target = "spmd_test_allreduce_without_transport"
        jax.ffi.register_ffi_target(target, mod.cpu_handlers()["spmd_allreduce"], platform="cpu")
        call = jax.ffi.ffi_call(
            target,
            (jax.ShapeDtypeStruct((1,), jnp.uint8), jax.ShapeDtypeStruct((3,), jnp.float32)),
            has_side_effect=True,
        )
        attrs = {"group": np.int64(gid), "meaning": "", "op": np.int32(0), "wire": np.int32(0),
                 "div": np.int64(1)}  # fmt: skip
        # The CPU handler, on the CPU also where JAX computes on a GPU by default.
        cpu = jax.default_device(jax.devices("cpu")[0])
        no_transport = r"spmd\.SpmdError: rank 0: allreduce: this group has no transport"
        with cpu, pytest.raises(Exception, match=no_transport):
            jax.block_until_ready(call(jnp.zeros(1, jnp.uint8), jnp.ones(3), **attrs))
    finally:
        mod.group_destroy(gid)


def test_python_takes_its_codes_from_the_native_tables():
    """The codes the native layer exports are those the Python side sends (no copy of them is
    kept in Python)."""
    from spmd.ops import _allreduce, _checks, _gpu_chain
    from spmd.ops._primitive import GroupRef
    from spmd.runtime._groups import transport_names

    tables = native().tables()
    assert _checks.REDUCE_OPS == tables["reduce_ops"] == {"sum": 0, "prod": 1, "max": 2, "min": 3}
    assert [str(d) for d in _checks.SUPPORTED_DTYPES] == list(tables["dtypes"])
    assert tables["wires"] == _allreduce.WIRES
    assert transport_names() == ("auto", "shm", "mpi", "hier")
    shift, roles = tables["role_shift"], tables["roles"]
    assert GroupRef(7, 0, (0,)).backward().attr == 7 | roles["backward"] << shift
    assert GroupRef(7, 0, (0,)).jvp().attr == 7 | roles["jvp"] << shift
    assert tables["algos"] == _gpu_chain.ALGOS and tables["codecs"] == _gpu_chain.CODECS
    assert tuple(tables["custom_dtypes"]) == _gpu_chain.CUSTOM_DTYPES


def test_the_gpu_module_exports_the_same_gpu_tables():
    from spmd._native_lib import native_cuda

    mod = native_cuda()
    if mod is None:
        pytest.skip("spmd was installed without its GPU module (no nvcc at install time)")
    tables = mod.tables()
    for name in ("algos", "codecs", "custom_dtypes"):
        assert tables[name] == native().tables()[name], name


@pytest.mark.parametrize("module", ["spmd._native", "spmd._native_cuda"])
def test_the_type_stubs_match_the_built_module(module):
    """src/spmd/_native.pyi and _native_cuda.pyi name exactly the functions the compiled module
    has, as mypy's stubtest finds them (mypy checks the stubs themselves with the package)."""
    import subprocess
    import sys

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not built here (spmd was built without CUDA)")
    out = subprocess.run([sys.executable, "-m", "mypy.stubtest", module],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
