"""The CUDA kernels' NVRTC is found without LD_LIBRARY_PATH: the one PyTorch has loaded
(`libnvrtc.so.13` or `.so.12` by name), the lib directories of PyTorch's NVIDIA wheels
(CUDA 12 and 13 layouts), or the file ATTN_NVRTC_PATH names. Each lookup runs in a fresh
interpreter, since a process keeps the first NVRTC it opens; those testing one way alone
load the native module without torch, which would load its own NVRTC first. The wheels
come from ATTN_CUDA_HOME, where CI installs NVRTC 12 (`nvidia/cuda_nvrtc`) and NVRTC 13
(`cu13/nvidia/cu13`): without ATTN_CUDA_HOME (a machine other than CI) those tests skip,
whatever ATTN_REQUIRE_GPU says. A build without the `cuda` feature, or a torch without
NVIDIA's NVRTC wheel, skips the rest, or fails them where ATTN_REQUIRE_GPU is set
(`gpu_policy`)."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import pytest

from attn_dilated import _kernels, _native
from gpu_policy import skip_gpu_test

NO_CUDA_FEATURE = "enable the `cuda` feature" in (_native.cuda_unavailable_reason(0) or "")


def needs_cuda_feature(test):
    """A test of the `cuda` feature's NVRTC lookup: skipped by a build without the
    feature, or failed where `ATTN_REQUIRE_GPU` is set (`gpu_policy`)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if NO_CUDA_FEATURE:
            skip_gpu_test(test.__name__, "this build of the package has no `cuda` feature")
        return test(*args, **kwargs)

    return run


# The native module alone, without the package (and so without torch).
NATIVE_ALONE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("attn_dilated._native", {_native.__file__!r})
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
"""


def cuda_home() -> pathlib.Path:
    home = os.environ.get("ATTN_CUDA_HOME")
    if not home:
        pytest.skip("ATTN_CUDA_HOME (where CI installs the NVRTC wheels) is not set")
    return pathlib.Path(home)


def fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with no LD_LIBRARY_PATH and no ATTN_NVRTC_PATH
    unless given; it prints the NVRTC's path and version on two lines."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "ATTN_NVRTC_PATH")}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120)


def native_lookup(dirs=(), **env: str) -> subprocess.CompletedProcess:
    code = NATIVE_ALONE + f"native.add_library_search_dirs({[str(d) for d in dirs]!r})\n"
    code += "path, version = native.nvrtc_library(); print(path); print(version)\n"
    return fresh(code, **env)


def test_the_lib_directories_of_nvidia_wheels_are_searched(tmp_path, monkeypatch):
    for sub in ("cu13", "cuda_nvrtc", "cublas"):
        (tmp_path / "nvidia" / sub / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "no_lib").mkdir()
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    dirs = _kernels.nvidia_lib_dirs()
    ours = [d for d in dirs if d.startswith(str(tmp_path))]
    assert ours == [str(tmp_path / "nvidia" / s / "lib") for s in ("cu13", "cublas", "cuda_nvrtc")], dirs


@needs_cuda_feature
def test_the_package_uses_the_nvrtc_of_torchs_wheels():
    wheels = [d for d in _kernels.nvidia_lib_dirs() if any(f.startswith("libnvrtc.so") for f in os.listdir(d))]
    if not wheels:
        skip_gpu_test(
            "test_the_package_uses_the_nvrtc_of_torchs_wheels",
            "this torch has no NVIDIA wheel holding libnvrtc (a CPU-only build)",
        )
    code = "import attn_dilated as ad; path, version = ad.nvrtc_library(); print(path); print(version)\n"
    code += "print([l.split()[-1] for l in open('/proc/self/maps') if '/libnvrtc.so' in l][0])\n"
    r = fresh(code)
    assert r.returncode == 0, r.stderr
    mapped = r.stdout.split("\n")[2]
    assert any(mapped.startswith(d) for d in wheels), (r.stdout, wheels)


@needs_cuda_feature
@pytest.mark.parametrize("lib_dir, version", [("nvidia/cuda_nvrtc/lib", "(12,"), ("cu13/nvidia/cu13/lib", "(13,")])
def test_nvrtc_is_found_in_an_added_directory(lib_dir, version):
    want = cuda_home() / lib_dir
    assert want.is_dir(), f"ATTN_CUDA_HOME is set but {want} is missing"
    r = native_lookup([want])
    assert r.returncode == 0, r.stderr
    path, got = r.stdout.split("\n")[:2]
    assert path.startswith(str(want)) and got.startswith(version), r.stdout


@needs_cuda_feature
def test_attn_nvrtc_path_is_the_only_candidate():
    real = cuda_home() / "cu13/nvidia/cu13/lib/libnvrtc.so.13"
    r = native_lookup(ATTN_NVRTC_PATH=str(real))
    assert r.returncode == 0 and r.stdout.startswith(str(real)), r.stdout + r.stderr
    # A directory that would be found is not searched when the named file does not load.
    r = native_lookup([real.parent], ATTN_NVRTC_PATH="/nonexistent/libnvrtc.so.13")
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "ATTN_NVRTC_PATH=/nonexistent/libnvrtc.so.13 did not load" in r.stderr


@needs_cuda_feature
def test_a_failed_lookup_says_what_it_searched():
    r = native_lookup(["/nonexistent-a"])
    if r.returncode == 0:
        pytest.skip(f"this machine's dynamic linker finds an NVRTC: {r.stdout.strip()}")
    assert "libnvrtc was not found: tried libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so" in r.stderr, r.stderr
    assert "ATTN_NVRTC_PATH" in r.stderr
