"""What a warm-started script spawns (`fixtures.warm_spawn`) behaves as a spawned process does.

vLLM on CPU starts its engine core and workers with multiprocessing's spawn; a test's engine
script forked from the fork server has those spawns forked from a copy of itself instead (vLLM
already imported). Each behaviour a spawning process sees is compared here with the same script
started cold, whose spawns are real ones: the child's arguments and environment, its queue to
the parent, exit statuses (a code, SIGTERM from `Process.terminate`, SIGKILL from
`Process.kill`, after which the child is gone, SIGKILL from elsewhere), what the child spawns,
a Ctrl-C of the script's process group, a child left running after the script ended (killed a
grace later, where a real spawn would run on); a spawn with the OpenMP variables vLLM sets for a CPU
worker of one thread (its threads' team size and CPU binding), and for a worker of a thread per
CPU (forked by a process started with that environment: its team's binding, and a Ctrl-C). A
run whose folder is too long for a socket's name spawns cold.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from vllm_helpers import engine_script_env

from fixtures.warm_spawn import ORPHAN_GRACE_ENV, ORPHANS_LOG
from fixtures.warm_start import KVPACK_MODULES, WarmStarts, warm_starts
from kvpack.tools.procfs import stat_fields

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, multiprocessing as mp, os, sys, threading, time

def openmp():
    import torch
    seen = {}
    def probe(name):
        torch.ones(256, 256).sum()  # this thread's first op: its OpenMP team is sized
        seen[name] = {"threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))}
    probe("main")
    # the bindings of the main thread's team (libgomp's threads), before a thread that ends (a
    # joined one may still be listed a moment after)
    seen["team"] = sorted({cpus(task) for task in os.listdir("/proc/self/task")} - {None})
    started = threading.Thread(target=probe, args=("started",))
    started.start()
    started.join()
    return seen

def cpus(task):  # a thread's CPUs; None if it ended meanwhile (a short-lived one of an import's)
    try:
        with open(f"/proc/self/task/{task}/status") as status:
            return [line.split()[1] for line in status if line.startswith("Cpus_allowed_list")][0]
    except (FileNotFoundError, ProcessLookupError):
        return None

def team(env):  # as vLLM's CPU executor sets them for a worker of a thread per CPU
    every = sorted(os.sched_getaffinity(0))
    env["OMP_NUM_THREADS"] = str(len(every))
    env["GOMP_CPU_AFFINITY"] = " ".join(map(str, every))

def grandchild(q, parent):
    q.put({"preloaded": "vllm" in sys.modules, "parent": mp.parent_process().pid == parent})

def spawn_grandchild():  # as vLLM's engine core spawns its workers
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=grandchild, args=(q, os.getpid()))
    p.start()
    said = q.get(timeout=60)
    p.join(60)
    return {**said, "exitcode": p.exitcode}

def child(q, how):
    q.put({"preloaded": "vllm" in sys.modules, "argv": sys.argv, "probe": os.environ.get("KVPACK_SPAWN_PROBE"),
           "omp": os.environ.get("OMP_NUM_THREADS"), "name": mp.current_process().name, "pid": os.getpid(),
           "parent": mp.parent_process().pid == int(os.environ["KVPACK_SCRIPT_PID"]),
           "openmp": openmp() if how.startswith("omp") else None,
           "nested": spawn_grandchild() if how == "nested" else None})
    if how == "exit":
        sys.exit(3)
    if how == "killed":  # as the OOM killer would
        time.sleep(0.2)  # (its message out first)
        os.kill(os.getpid(), 9)
    if how == "wait":
        try:
            time.sleep(120)
        except KeyboardInterrupt:  # a Ctrl-C of the group
            q.put("interrupted")
            sys.exit(4)

def gone(pid):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1][0] == "Z":
                    return True  # ended; its parent has not reaped it yet
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False

if __name__ == "__main__":
    os.environ["KVPACK_SCRIPT_PID"] = str(os.getpid())
    ctx = mp.get_context("spawn")
    if sys.argv[1] == "statuses":
        results = {}
        for case in ("end", "exit", "term", "kill", "killed", "nested", "omp", "omp-team", "omp-team-again"):
            q = ctx.Queue()  # one each: a child killed while its queue's feeder holds the lock leaves it held
            if case == "omp":  # as vLLM's CPU executor sets them for a worker of one thread on the last CPU
                os.environ["OMP_NUM_THREADS"] = "1"
                os.environ["GOMP_CPU_AFFINITY"] = str(max(os.sched_getaffinity(0)))
            if case == "omp-team":
                team(os.environ)
            p = ctx.Process(target=child, args=(q, "wait" if case in ("term", "kill") else case), name=f"probe-{case}")
            p.start()
            said = q.get(timeout=60)
            if case == "term":
                p.terminate()
            if case == "kill":
                p.kill()
            p.join(60)
            results[case] = {"exitcode": p.exitcode, "said": said, "gone": gone(said["pid"])}
        print(json.dumps(results), flush=True)
    else:
        if sys.argv[1] == "interrupt-team":  # a child forked by its environment's spawn server
            team(os.environ)
            first = ctx.Process(target=child, args=(ctx.Queue(), "end"))  # (starts that server if none has)
            first.start()
            first.join(60)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q, "wait"))
        p.start()
        q.get(timeout=60)
        try:
            print("ready", flush=True)
            p.join(60)
        except KeyboardInterrupt:
            pass
        p.join(60)
        print(json.dumps({"exitcode": p.exitcode, "said": q.get(timeout=10)}), flush=True)
"""


def _start(tmp_path: Path, how: str, cold: bool):  # type: ignore[no-untyped-def]
    script = tmp_path / "spawner.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{how}-{'cold' if cold else 'warm'}.out"
    env = engine_script_env(KVPACK_SPAWN_PROBE="probe")
    proc = warm_starts().start_script(
        sys.executable, [str(script), how], env, out, tmp_path / "err", cold=cold, new_session=True, warm_spawns=True
    )
    return proc, out


def _spawns_log() -> list[dict]:
    log = warm_starts().spawns_log
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_spawn_from_a_warm_script_ends_as_a_real_spawn_does(tmp_path: Path) -> None:
    results = {}
    before = len(_spawns_log())
    for cold in (True, False):
        proc, out = _start(tmp_path, "statuses", cold)
        assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()
        results[cold] = json.loads(out.read_text().splitlines()[-1])
    real, forked = results[True], results[False]
    assert {case: r["exitcode"] for case, r in real.items()} == {
        "end": 0, "exit": 3, "term": -signal.SIGTERM, "kill": -signal.SIGKILL, "killed": -signal.SIGKILL, "nested": 0,
        "omp": 0, "omp-team": 0, "omp-team-again": 0,
    }  # fmt: skip
    for case, r in real.items():
        f = forked[case]
        assert f["exitcode"] == r["exitcode"] and f["gone"] and r["gone"], case
        same = {k: v for k, v in r["said"].items() if k not in ("pid", "preloaded", "nested")}
        assert {k: v for k, v in f["said"].items() if k not in ("pid", "preloaded", "nested")} == same, case
        assert r["said"]["preloaded"] is False
        assert f["said"]["preloaded"] is True, case  # forked with vLLM imported
    assert real["end"]["said"]["probe"] == "probe"
    # what a forked child spawns (vLLM's engine core its workers) is forked too
    assert real["nested"]["said"]["nested"] == {"preloaded": False, "parent": True, "exitcode": 0}
    assert forked["nested"]["said"]["nested"] == {"preloaded": True, "parent": True, "exitcode": 0}
    # the spawned worker's libgomp bound it and sized its teams at load (so the forked one had to)
    cpu = real["omp"]["said"]["openmp"]["main"]["cpus"]
    assert len(cpu) == 1
    assert {t: real["omp"]["said"]["openmp"][t] for t in ("main", "started")} == {
        t: {"threads": 1, "cpus": cpu} for t in ("main", "started")
    }
    # a team: libgomp bound the main thread to the first CPU and each of its threads to the next
    every = real["omp-team"]["said"]["openmp"]
    assert every["main"]["threads"] == len(set(every["team"])) > 1 and len(every["main"]["cpus"]) == 1, every
    spawned = [s for s in _spawns_log()[before:] if "spawn_main" in s["argv"][1]]
    # a team's spawns: not the zygote's (a line each), forked by their environment's spawn server
    # (a line each; the first spawn started it, or an engine's worker before this test)
    assert [s["cold"] is None for s in spawned] == [True] * 8 + [False, True] * 2, spawned
    assert "a team of threads" in spawned[-2]["cold"]


@pytest.mark.parametrize(
    ("cold", "how"),
    [(True, "interrupt"), (False, "interrupt"), (False, "interrupt-team")],
    ids=["spawned", "forked", "forked-by-its-environments-server"],
)
def test_a_ctrl_c_of_the_group_reaches_the_spawned_process(tmp_path: Path, cold: bool, how: str) -> None:
    import time

    proc, out = _start(tmp_path, how, cold)
    deadline = time.monotonic() + 120
    while "ready" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    assert json.loads(out.read_text().splitlines()[-1]) == {"exitcode": 4, "said": "interrupted"}


TINY = """
import multiprocessing as mp, sys

def child(q):
    q.put("spawned")

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60), flush=True)
    p.join(60)
    sys.exit(p.exitcode)
"""


def test_a_folder_too_long_for_a_socket_name_spawns_cold(tmp_path: Path) -> None:
    # a Unix socket's name holds 108 bytes; a run whose folder is longer (pytest's --basetemp)
    # spawns as without the zygote instead of failing the script at bind
    starts = WarmStarts(tmp_path / ("d" * 110))
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    try:
        done = starts.run_script(
            sys.executable,
            [str(script)],
            dict(os.environ),
            tmp_path / "log",
            120,
            modules=KVPACK_MODULES,
            warm_spawns=True,
        )
    finally:
        starts.close()
    assert (done.returncode, done.stdout) == (0, "spawned\n"), done.stderr
    assert "no zygote" in done.stderr and not starts.spawns_log.exists()


ORPHAN = """
import json, multiprocessing as mp, os, sys, time

def child(q):
    q.put(os.getpid())
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(json.dumps({"child": q.get(timeout=60), "wrapper": p.pid}), flush=True)
    os._exit(0)  # ends without joining or stopping its child (a vLLM engine core that died)
"""


def _running(pid: int) -> bool:
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] != "Z"


def test_a_child_left_running_after_the_script_ended_is_killed_after_a_grace(tmp_path: Path) -> None:
    # a forked child is the zygote's, outside the script's process tree: one stuck after its
    # parent ended (a vLLM TP worker blocked in its shutdown) would keep its memory for the rest of
    # the run; the zygote kills it the grace after the script ended (here 1 s)
    import time

    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    out = tmp_path / "orphan.out"
    env = engine_script_env(**{ORPHAN_GRACE_ENV: "1"})
    proc = warm_starts().start_script(
        sys.executable, [str(script)], env, out, tmp_path / "err", cold=False, new_session=True, warm_spawns=True
    )
    assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    pids = json.loads(out.read_text().splitlines()[-1])
    assert pids["child"] != pids["wrapper"]  # forked by the zygote, not spawned
    deadline = time.monotonic() + 30
    while _running(pids["child"]) or _running(pids["wrapper"]):
        assert time.monotonic() < deadline, f"the script's child {pids} still runs 30 s after the script ended"
        time.sleep(0.1)
    orphans = warm_starts().spawns_log.with_name(ORPHANS_LOG)
    killed = [json.loads(line) for line in orphans.read_text().splitlines()]
    # (with the resource tracker multiprocessing started for the script, which the child kept open)
    assert any(pids["child"] in k["killed"] and k["after_s"] == 1.0 for k in killed), killed
