"""Shared pytest set-up: fixtures live in tests/fixtures/ (one module per real part).

`kvpack` is mapped onto this checkout first when no install provides it (a python with
torch and the core's small dependencies only, as on a lent GPU machine): the fixture
plugins below import `kvpack.tools`. None of them imports an engine or Mooncake at import
time; a suite that needs one starts it in a fixture.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Iterator

import pytest

import kvpack_checkout

kvpack_checkout.map_checkout()

# Every engine the tests start runs eager (``enforce_eager``, ``--enforce-eager``): what
# torch.compile would still trace is a few small helpers of the engines' samplers (vLLM's
# logprob rank count), traced again in every new engine process, where it cost more than
# the engine's own start. Eager, they return the same integers; no test is about the
# compiler. Set before any test imports torch, inherited by every engine process a test
# starts. A caller who wants the compiler sets TORCHDYNAMO_DISABLE=0.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

pytest_plugins = [
    name
    for name in ("fixtures.common", "fixtures.mooncake", "fixtures.tiny_model")
    if importlib.util.find_spec(name) is not None
]


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background (``make test &``, or under a shell without job
    control) inherits SIGINT ignored, and every child it starts would too: the tests that
    stop a process the way Ctrl-C does would then see it ignore the signal. Catching it here
    (Python's own handler) makes each child start with the default, as under a terminal:
    exec resets a caught signal, never an ignored one."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _engine_sockets_in_the_run_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM names its processes' ZMQ sockets ``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` (/tmp unless
    told), and a process that is stopped leaves its socket files behind: a full run left some 160
    in /tmp. The run's go in its own temporary folder (pytest keeps the last three runs')."""
    folder = tmp_path_factory.getbasetemp() / "rpc"
    folder.mkdir(exist_ok=True)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(folder))


@pytest.fixture(scope="session", autouse=True)
def _drop_the_host_stores_of_this_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A host store outlives its processes (`kvpack.tiers.host.stores`). Every store this run
    made is named after a disk folder under its own temporary root (`disk_store_name`; tests
    with the disk off name theirs and drop them): those with no live user go when the run
    ends, so a run leaves /dev/shm as it found it and never touches a store another run,
    or a user, made. A store's name differs with its disk folder: tests never share one."""
    base = os.path.realpath(tmp_path_factory.getbasetemp())
    yield
    from kvpack.tiers.host import disk_store_name, drop, host_stores

    names = {s.name for s in host_stores()}
    if not names:
        return
    for folder, _, _ in os.walk(base):
        name = disk_store_name(folder)
        if name in names:
            drop(name)
