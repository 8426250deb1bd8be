"""The CUDA sources compile, and the GPU module loads on a machine without a GPU.

pip builds ``spmd._native_cuda`` wherever nvcc is found (CMake's SPMD_CUDA=AUTO). Where spmd was
installed without it but nvcc is present, this test compiles the module itself, so CI machines
without a GPU still catch CUDA code that no longer compiles."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from spmd._native_lib import native, native_cuda

ROOT = Path(__file__).parents[2]
# The MoE exchange is CPU only: on a GPU spmd.moe composes it from all_to_allv. spmd_after (the
# calls' order, spmd.ops.after) too: on a GPU it hands its values back as they are.
CPU_ONLY = {"spmd_moe_exchange", "spmd_after"}
EXPECTED = {
    "spmd_cuda_" + name.removeprefix("spmd_")
    for name in native().cpu_handlers()
    if name not in CPU_ONLY
}
EXPECTED.add("spmd_cuda_allreduce_rmsnorm")

_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import _native_cuda as m
print(" ".join(sorted(m.cuda_handlers())))
try:
    m.device_info()
except RuntimeError as e:
    assert "no usable CUDA device" in str(e), e
"""


def test_installed_gpu_module_has_every_handler():
    mod = native_cuda()
    if mod is None:
        pytest.skip("spmd was installed without its GPU module (no nvcc at install time)")
    assert set(mod.cuda_handlers()) == EXPECTED
    # Importing touched no GPU; without one, asking for the device is a clear error.
    try:
        name, bus, major, _, sms = mod.device_info()
        assert name and bus and major >= 7 and sms > 0
    except RuntimeError as e:
        assert "no usable CUDA device" in str(e)


def test_cuda_sources_compile(tmp_path):
    if native_cuda() is not None:
        pytest.skip("the installed GPU module was compiled from these sources by pip")
    if shutil.which("nvcc") is None or shutil.which("cmake") is None:
        pytest.skip("no nvcc (or no cmake) on PATH: the CUDA sources cannot be compiled here")
    if not (ROOT / "native" / "cuda").is_dir():
        pytest.skip("not a source checkout")
    build = tmp_path / "build"
    configure = [
        "cmake", "-S", str(ROOT), "-B", str(build), "-DSPMD_CUDA=ON",
        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_CUDA_ARCHITECTURES=90",
        f"-DPython_INCLUDE_DIR={sysconfig.get_paths()['include']}",
    ]  # fmt: skip
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "_native_cuda", "-j2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, str(build)], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    assert set(probe.stdout.split()) == EXPECTED
