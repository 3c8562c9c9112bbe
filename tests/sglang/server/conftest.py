"""tests/sglang/server: the optional CPU SGLang server test, ignored (like tests/sglang) without SGLang.

Checks the installed distribution, not ``find_spec("sglang")``: with ``tests/`` on
``sys.path`` (pyproject's ``pythonpath``), ``tests/sglang`` itself is found as a
namespace package named ``sglang``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

import pytest

try:
    version("sglang")
except PackageNotFoundError:
    collect_ignore_glob = ["test_*.py"]

BUILD_HASH_EXTENSION = (
    "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module; _load_native_hash_module()"
)


@pytest.fixture(scope="session", autouse=True)
def sglang_hash_extension_built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SGLang's HiCache page hash (a torch C++ extension SGLang JIT-builds under
    ``~/.cache/torch_extensions`` on first use) built, or found built, before the first server
    starts, in the servers' venv and environment. A server that builds it at its first request
    answers that request before its storage prefetch, and one stopped mid-build leaves a lock
    the next removes (then builds again); the build's include paths name the venv, so another
    venv's build is rebuilt. A user's second start finds it built. A build that fails is a
    warning here; the servers then do what SGLang does without it."""
    from sglang_cpu_server import server_env

    from fixtures.warm_start import SGLANG_MODULES, warm_starts

    log = tmp_path_factory.mktemp("hash-extension") / "build.log"
    done = warm_starts().run_script(
        sys.executable,
        ["-c", BUILD_HASH_EXTENSION],
        server_env(),
        log,
        600,
        modules=SGLANG_MODULES,
        cwd=str(log.parent),
    )
    if done.returncode != 0:
        warnings.warn(f"SGLang's hash extension did not build (see {log}): {done.stderr[-500:]}", stacklevel=1)
    yield
