"""Test-only start-up hook for the CPU SGLang server of ``test_sglang_server.py``. Never part of kvpack.

Python imports ``sitecustomize`` at start-up from PYTHONPATH; the test puts this
folder on PYTHONPATH of the server subprocess only (SGLang's scheduler and
detokenizer processes inherit it). It:

1. defines the ``torchvision::nms``/``qnms`` op schemas (``../../kvpack_sglang_shim.py``)
   so PyPI's CUDA-linked torchvision imports on a CPU torch;
2. installs stand-ins for ``xgrammar``, ``jsonschema``, ``soundfile`` where absent
   (``cpu_server_stand_ins.py``);
3. moves this folder to the end of ``sys.path``, so the stub ``sgl_kernel`` package
   here is used only where no real one is installed;
4. installs the SGLang patches of ``cpu_server_patches.py`` (no CUDA host-register,
   torch copies for the ``direct`` HiCache IO kernels, a smaller host-memory reserve);
5. with ``KVPACK_SGLANG_PREFETCH_PROBE=1`` (the multi-turn bench), the L3 prefetch timing
   probe of ``cpu_server_probe.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _install() -> None:
    _load("kvpack_sglang_shim", _HERE.parents[1] / "kvpack_sglang_shim.py")
    here = str(_HERE)
    sys.path[:] = [p for p in sys.path if p != here] + [here]
    import cpu_server_patches
    import cpu_server_stand_ins

    cpu_server_stand_ins.install()
    cpu_server_patches.install()
    if os.environ.get("KVPACK_SGLANG_PREFETCH_PROBE") == "1":
        import cpu_server_probe

        cpu_server_probe.install()


_install()
