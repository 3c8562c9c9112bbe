"""The fork server engine scripts start from (`fixtures.warm_start`) ends them as Python ends a script.

A script forked from the server must behave as the same script in a fresh interpreter: its
own argv, environment, working folder and output files; atexit handlers and interpreter
finalization at its end; status 1 and a traceback for an uncaught exception, -N for a
signal; kvpack imported by the script, never by the server. Each is compared here with the
same script started cold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.warm_start import WarmStarts, warm_starts

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import atexit, json, os, sys
preloaded = "kvpack" in sys.modules
import kvpack.identity.keys  # the script's own import, as vLLM's plugin loader would make it
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("KVPACK_WARM_START_PROBE"),
    "main": sys.modules["__main__"].__file__, "kvpack_preloaded": preloaded,
    "path0": sys.path[0], "ppid_is_test": os.getppid() == int(os.environ["KVPACK_TEST_PID"]),
    "first_free_fd": os.open(os.devnull, os.O_RDONLY),
}), flush=True)
how = sys.argv[1]
if how == "raise":
    raise ValueError("the script failed")
if how == "exit":
    sys.exit(3)
if how == "wait":
    sys.stdin.read()  # /dev/null: returns at once
    import time
    time.sleep(60)
"""


@pytest.fixture
def starts() -> WarmStarts:
    """The run's fork servers (the probes' variables are kvpack's: they share the engine tests' server)."""
    return warm_starts()


def _run(starts: WarmStarts, tmp_path: Path, how: str, cold: bool) -> tuple[int, dict, str, str]:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    folder = tmp_path / ("cold" if cold else "warm")
    folder.mkdir(exist_ok=True)
    out, err = folder / "out", folder / "err"
    env = dict(os.environ, KVPACK_WARM_START_PROBE="probe", KVPACK_TEST_PID=str(os.getpid()))
    proc = starts.start_script(sys.executable, [str(script), how], env, out, err, cold=cold, cwd=str(folder))
    rc = proc.wait(timeout=120)
    stdout = out.read_text()
    return rc, json.loads(stdout.splitlines()[0]), stdout, err.read_text()


@pytest.mark.parametrize(("how", "status"), [("end", 0), ("exit", 3), ("raise", 1)])
def test_a_forked_script_ends_as_the_same_script_started_cold(
    starts: WarmStarts, tmp_path: Path, how: str, status: int
) -> None:
    cold = _run(starts, tmp_path, how, cold=True)
    warm = _run(starts, tmp_path, how, cold=False)
    for rc, seen, stdout, stderr in (cold, warm):
        assert rc == status, stderr
        assert seen["argv"][1:] == [how] and seen["env"] == "probe" and seen["cwd"].endswith(("cold", "warm"))
        assert seen["main"] == seen["argv"][0] and seen["path0"] == str(tmp_path)
        assert seen["kvpack_preloaded"] is False
        assert seen["first_free_fd"] > 2  # stdin, stdout and stderr open (libuv aborts on a socket at fd 0)
        assert stdout.splitlines()[-1] == "atexit ran"
        assert ("ValueError: the script failed" in stderr) == (how == "raise")
    assert cold[1]["ppid_is_test"] and not warm[1]["ppid_is_test"]  # the warm one is the server's child


def test_a_signal_ends_a_forked_script_with_minus_its_number(starts: WarmStarts, tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    env = dict(os.environ, KVPACK_TEST_PID=str(os.getpid()))
    proc = starts.start_script(sys.executable, [str(script), "wait"], env, out, tmp_path / "err")
    deadline = time.monotonic() + 120
    while not out.read_text():  # the script has started (it prints first)
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert proc.returncode == -signal.SIGTERM


PROBE_MODULE = "import json, os, sys; print(json.dumps([__name__, sys.argv, sys.path[0], os.getcwd()]))"


@pytest.mark.parametrize("form", ["-m", "-c"])
def test_python_dash_m_and_dash_c_run_as_python_runs_them(starts: WarmStarts, tmp_path: Path, form: str) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE_MODULE)
    argv = ["-m", "probe_module", "x"] if form == "-m" else ["-c", PROBE_MODULE, "x"]
    seen = []
    for cold in (True, False):
        out = tmp_path / f"out-{cold}"
        proc = starts.start_script(sys.executable, argv, dict(os.environ), out, out, cold=cold, cwd=str(tmp_path))
        assert proc.wait(timeout=120) == 0, out.read_text()
        seen.append(json.loads(out.read_text().splitlines()[-1]))
    assert seen[0] == seen[1]
    assert seen[0][0] == "__main__" and seen[0][1][1:] == ["x"]


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_output_files_are_emptied_first_unless_appended_to(starts: WarmStarts, tmp_path: Path, cold: bool) -> None:
    """A script's output files start empty (a test reads what this script wrote); a server's
    second lifetime appends to the first's log (``append``)."""
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    fresh.write_text("an earlier script's\n")
    kept.write_text("the first lifetime's\n")
    for out, append in ((fresh, False), (kept, True)):
        argv = ["-c", "print('this one')"]
        proc = starts.start_script(sys.executable, argv, dict(os.environ), out, out, cold=cold, append=append)
        assert proc.wait(timeout=120) == 0, out.read_text()
    assert fresh.read_text() == "this one\n"
    assert kept.read_text() == "the first lifetime's\nthis one\n"


ECHO = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\nprint('stdin closed')"


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_pipes_to_a_script_work_as_popens(starts: WarmStarts, tmp_path: Path, cold: bool) -> None:
    """stdin and stdout as pipes (text): a line written is read, a line printed arrives while the
    script runs, closing stdin is its end of input."""
    err = tmp_path / "err"
    argv = ["-c", ECHO]
    proc = starts.start_script(
        sys.executable, argv, dict(os.environ), subprocess.PIPE, err, stdin=subprocess.PIPE, cold=cold
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("one\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "got one\n"  # answered before stdin closed
    proc.stdin.close()
    assert proc.stdout.read() == "stdin closed\n"
    assert proc.wait(timeout=120) == 0, err.read_text()
    proc.stdout.close()
