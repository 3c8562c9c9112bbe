"""OPTIONAL server test: a multi-turn chat whose working set exceeds SGLang's device pool and
HiCache L2, against a real CPU SGLang server with kvpack as L3 (SGLang's own HiCache
benchmark shape, ``benchmark/hicache/bench_multiturn.py``: clients x rounds, each round
appending a question to the client's whole history, greedy).

The server (see ``sglang_cpu_server``) runs with a device pool of `DEVICE_TOKENS` and an L2
host pool of twice that; `CLIENTS` clients of `ROUNDS` rounds grow to a working set well
beyond both, so later rounds find their history in L3 only. kvpack keeps a small memory tier
(evicting) over its disk tier. The checks read SGLang's own counters and log:

- every page SGLang asks kvpack to write is written: no ``Write page to storage: N pages
  failed`` in the log, and kvpack's disk store holds every full page of every history;
- every page kvpack says it holds is loaded: SGLang's storage hits
  (``sglang:storage_prefetch_hit_tokens_total``) are positive and none of them fell short in
  the transfer (``sglang:storage_prefetch_unfulfilled_tokens_total{reason="storage_transfer"}``
  is 0, no ``failed to retrieve page`` in the log);
- no failed L3 call: kvpack logged no ``failed, answering a miss``;
- the answers of the last round equal a second pass over the same histories (greedy).

About 70 s on 2 cores, most of it the server's start-up. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

import pytest
from sglang_cpu_server import CpuServer, ServerError, running_cpu_server, wait_for_stored_pages

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

PAGE_SIZE = 16
DEVICE_TOKENS = 1024
CLIENTS = 6
ROUNDS = 3
QUESTION_TOKENS = 256  # a round's new prompt tokens, above SGLang's L3 prefetch threshold (256)
ANSWER_TOKENS = 8
TENANT = "default"
SERVER_ARGS = (
    "--max-total-tokens", str(DEVICE_TOKENS),
    "--hicache-size", "0", "--hicache-ratio", "2",  # L2 host pool: 2x the device pool
    "--enable-metrics",
)  # fmt: skip
GREEDY = {"temperature": 0.0, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
FAILED_WRITE = "Write page to storage"
FAILED_READ = "failed to retrieve page"
FAILED_CALL = "failed, answering a miss"


def kvpack_extra_config(store: Path) -> dict[str, object]:
    """kvpack with a memory tier smaller than the working set (it evicts) over a disk store."""
    return {
        "backend_name": "kvpack",
        "module_path": "kvpack.sglang_plugin",
        "class_name": "KVPackStorage",
        "interface_v1": 1,
        "tenant": TENANT,
        "memory": {"capacity": "8MiB"},
        "disk": {"path": str(store), "capacity": "1GiB"},
    }


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter over the samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.eE+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def run_rounds(server: CpuServer) -> tuple[list[list[int]], list[list[int]], int]:
    """Every client's rounds, the clients in parallel: (histories before the last round's answer,
    the last round's answers, tokens SGLang reported served from storage)."""
    histories: list[list[int]] = [[] for _ in range(CLIENTS)]
    last_prompts: list[list[int]] = [[] for _ in range(CLIENTS)]
    answers: list[list[int]] = [[] for _ in range(CLIENTS)]
    storage = [0] * CLIENTS
    errors: list[BaseException] = []

    def client(c: int) -> None:
        rng = random.Random(c)
        try:
            for r in range(ROUNDS):
                histories[c] += [rng.randrange(50, 1900) for _ in range(QUESTION_TOKENS)]
                last_prompts[c] = list(histories[c])
                out = server.generate(f"client {c} round {r + 1}", histories[c], GREEDY)
                details = out["meta_info"].get("cached_tokens_details") or {}
                storage[c] += int(details.get("storage", 0) or 0)
                answers[c] = list(out["output_ids"])
                histories[c] += answers[c]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return last_prompts, answers, sum(storage)


@pytest.mark.slow
def test_multiturn_beyond_device_and_l2_is_served_from_kvpack(tiny_llama: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    log = tmp_path / "server.log"
    try:
        with running_cpu_server(
            tiny_llama,
            kvpack_extra_config(store),
            log,
            page_size=PAGE_SIZE,
            dtype="float32",
            server_args=SERVER_ARGS,
        ) as server:
            prompts, answers, storage_tokens = run_rounds(server)
            # the second pass: every history again, now long gone from the device and L2
            again = [server.generate(f"client {c} again", p, GREEDY)["output_ids"] for c, p in enumerate(prompts)]
            # every full page of every history (its last token has no KV yet) is backed up to kvpack
            pages = sum((len(p) + ANSWER_TOKENS - 1) // PAGE_SIZE for p in prompts)
            began, limit_s = time.monotonic(), server.limits.backup_s
            stored = wait_for_stored_pages(store, TENANT, "kv", pages, timeout_s=limit_s)
            if stored < pages:
                step = "L3 backups reaching kvpack's disk store"
                raise server.error(step, f"kvpack holds {stored} of {pages} pages", began=began, limit_s=limit_s)
            text = server.metrics()
            tail = server.log_tail()
            full_log = log.read_text(errors="replace")
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)

    working_set = sum(len(p) + ANSWER_TOKENS for p in prompts)
    assert working_set > 3 * DEVICE_TOKENS, working_set  # beyond the device pool and L2 together
    for needle in (FAILED_WRITE, FAILED_READ, FAILED_CALL):
        lines = [line for line in full_log.splitlines() if needle in line]
        assert not lines, f"{len(lines)} lines with {needle!r}, first: {lines[0]}\n{tail}"
    hits = counter(text, "sglang:storage_prefetch_hit_tokens_total")
    short = counter(text, "sglang:storage_prefetch_unfulfilled_tokens_total", reason="storage_transfer")
    from_storage = counter(text, "sglang:cached_tokens_total", cache_source="storage")
    backed_up = counter(text, "sglang:backuped_tokens_total")
    print(
        f"working set {working_set} tokens; SGLang backed up {backed_up:.0f} tokens, kvpack holds {stored} pages; "
        f"storage hits {hits:.0f} tokens, {short:.0f} short in transfer; served from storage {from_storage:.0f} "
        f"(rounds: {storage_tokens}); start-up {server.start_s:.0f} s"
    )
    assert hits > 0 and from_storage > 0, f"no tokens from kvpack: hits {hits}, served {from_storage}\n{tail}"
    assert short == 0, f"{short} storage-hit tokens fell short in the transfer\n{tail}"
    assert again == answers, "a history served from kvpack answered differently"
