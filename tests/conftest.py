"""Shared pytest set-up: fixtures live in tests/fixtures/ (one module per real part)."""

from __future__ import annotations

import importlib.util
import signal

import pytest

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
