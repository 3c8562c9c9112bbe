"""Building the kernels: nvcc compiles the CUDA source, the CUDA branch of the binding
compiles, the fallback runs (and says so once) without a compiler, fake kernels exist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvpack.ops import load_extension
from kvpack.ops._build import csrc_dir

CSRC = csrc_dir()
HERE = Path(__file__).resolve().parent


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (
        ("/usr/local/cuda/bin/nvcc") if Path("/usr/local/cuda/bin/nvcc").is_file() else None
    )


def _cuda_include() -> Path | None:
    nvcc = _nvcc()
    roots = [Path(nvcc).resolve().parent.parent] if nvcc else []
    roots += [Path("/usr/local/cuda")]
    for r in roots:
        for inc in (r / "include", r / "targets" / "x86_64-linux" / "include"):
            if (inc / "cuda_runtime.h").is_file():
                return inc
    return None


def test_sources_found() -> None:
    assert CSRC is not None and (CSRC / "block_copy.cu").is_file()


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernel_compiles_with_nvcc(tmp_path: Path, arch: str) -> None:
    assert CSRC is not None
    for cu in sorted(CSRC.glob("*.cu")):
        obj = tmp_path / f"{cu.stem}.o"
        r = subprocess.run(
            [_nvcc(), "-c", "-O3", "-std=c++17", f"-arch={arch}", "-Werror", "all-warnings", "-o", str(obj), str(cu)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert obj.stat().st_size > 0


@pytest.mark.skipif(shutil.which("g++") is None or os.uname().machine != "x86_64", reason="needs g++ on x86-64")
@pytest.mark.parametrize("flags", [[], ["-mno-sse2"]], ids=["sse2+avx512", "scalar"])
def test_the_cpu_canonical_copy_compiles_at_every_simd_level(flags: list[str]) -> None:
    """The C++ sources with and without SSE2 (the build of a CPU without it, e.g. aarch64:
    scalar code only, no AVX-512 either), warnings as errors. Each level's bytes are
    checked in tests/common/test_canonical_copy.py."""
    assert CSRC is not None
    for cpp in ("canonical_copy_cpu.cpp", "block_copy_cpu.cpp"):
        r = subprocess.run(
            ["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", *flags, str(CSRC / cpp)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr


@pytest.mark.skipif(_cuda_include() is None, reason="no cuda_runtime.h (CUDA toolkit) on this machine")
def test_binding_cuda_branch_compiles(tmp_path: Path) -> None:
    """bindings.cpp with -DKVPACK_WITH_CUDA: the code the GPU machine builds, torch CPU headers only."""
    from torch.utils.cpp_extension import include_paths

    assert CSRC is not None
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler {cxx!r}")
    incs = [f"-I{p}" for p in include_paths()] + [f"-I{_cuda_include()}", f"-I{CSRC}"]
    r = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", "-DKVPACK_WITH_CUDA", *incs, str(CSRC / "bindings.cpp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def test_fallback_without_compiler_matches_and_logs_once(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import logging, sys
        sys.path.insert(0, {str(HERE)!r})
        import conftest  # maps kvpack to the checkout when not installed
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        import torch
        from kvcases import build, expected_staging
        from kvpack.ops import Backend, gather_blocks, load_extension
        case = build("flash_block_first_hnd", torch.bfloat16)
        for ids in ([3, 1, 3], [0, 8]):
            out = torch.full((len(ids) * case.kv.layout.slot_bytes,), 0xAB, dtype=torch.uint8)
            assert gather_blocks(case.kv, ids, out) is Backend.TORCH
            assert torch.equal(out, expected_staging(case, ids, 0xAB))
        print("STATUS", load_extension().reason)
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "STATUS C++ compiler" in r.stdout and "not found" in r.stdout
    assert r.stderr.count("pure-torch block copy fallback") == 1, r.stderr
    assert not (tmp_path / "cache" / "kvpack").exists()  # nothing was built


def test_fake_kernels_registered() -> None:
    status = load_extension()
    if not status.available:
        pytest.skip(status.reason)
    from torch._library.simple_registry import singleton
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    for op in ("gather_blocks", "scatter_blocks", "canonical_copy"):  # a fake kernel per op, from our loader
        kernel = singleton.find(f"kvpack::{op}").fake_impl.kernel
        assert kernel is not None, f"kvpack::{op} has no fake kernel"
        assert "ops/_build.py" in kernel.source.replace("\\", "/"), kernel.source
    assert singleton.find("kvpack::no_such_op").fake_impl.kernel is None  # the lookup can say no

    layer = torch.zeros(4, 2, 3, 8)
    with FakeTensorMode() as mode:
        fake_layer = mode.from_tensor(layer)
        table = torch.zeros(1, dtype=torch.int64)
        ids = torch.zeros(2, dtype=torch.int64)
        out = torch.empty(2 * 2 * 3 * 8 * 4, dtype=torch.uint8)
        geometry = [1, 1, 192, 2, 96, 3, 32, 32, 0, 0, 3, 4]
        # the ops run on fake tensors (no data, no native kernel) and, as their schema says, return nothing
        assert torch.ops.kvpack.gather_blocks([fake_layer], table, ids, out, geometry, 16, 0) is None
        assert torch.ops.kvpack.scatter_blocks([fake_layer], table, ids, out, geometry, 16, 0) is None
        assert isinstance(out, FakeTensor) and isinstance(fake_layer, FakeTensor)
    assert not layer.any()  # the real tensor behind the fake one was never written


def test_opcheck_schema_and_fake() -> None:
    """torch.library.opcheck: mutation annotations and fake kernels agree with the real op."""
    status = load_extension()
    if not status.available:
        pytest.skip(status.reason)
    from kvcases import build

    case = build("flash_kv_first", torch.float32)
    kv, lay = case.kv, case.kv.layout
    ids = torch.tensor([2, 5], dtype=torch.int64)
    out = torch.zeros(2 * lay.slot_bytes, dtype=torch.uint8)
    geometry = lay.kernel_geometry(2, 0, lay.tokens_per_block)
    args = (list(kv.tensors), kv.pointer_table(), ids, out, geometry, 16, 0)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.kvpack.gather_blocks.default, args, test_utils=tests)
    torch.library.opcheck(torch.ops.kvpack.scatter_blocks.default, args, test_utils=tests)
