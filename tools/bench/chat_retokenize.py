"""How often a chat template and re-tokenisation break reuse of turn k inside turn k+1.

vLLM's OpenAI chat endpoint with kvpack (memory and a fresh disk tier; vLLM's prefix cache off,
so every reused token is kvpack's) and a real Jinja chat template on the tiny
test model. Users share a system prompt, each has N rounds; an answer ends at a
stop token (``stop_token_ids``: a few vocabulary words, as EOS ends a real
model's answer) or by length. For each turn k+1 the tool compares, with the
token ids the server returns (``return_token_ids``):

- computed_k = prompt_k + answer_k minus its last token: what turn k left in
  kvpack (everything it computed);
- common = the longest common prefix of computed_k and prompt_k+1: what the
  template and re-tokenisation keep of it (the "kept" turns keep it all);
- cached = ``usage.prompt_tokens_details.cached_tokens`` of turn k+1: what kvpack
  actually served (at most len(prompt_k+1) - 1).

Run: ``python -m kvpack.tools.bench.chat_retokenize [--users 6 --rounds 4]``
(prints one JSON line). Needs the vLLM venv; builds the tiny model in a temp folder.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from kvpack.tools.ports import free_port

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)
"""ChatML-like: each turn between <s> and </s>, the role word first (the tiny tokenizer splits
on whitespace, so each piece is one token; role names are <unk> to it)."""


@dataclass(frozen=True)
class Turn:
    """One follow-up turn (k+1 >= 2) of one user; token counts."""

    computed_prev: int
    common: int
    cached: int
    prompt: int
    prev_finish: str
    first_diff: tuple[int, int] | None
    """(turn k's token, turn k+1's token) at the first position they differ (None: kept)."""


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return dict(json.loads(resp.read()))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(n))


def _conversation(port: int, model: str, user: int, rounds: int, system: str, stops: list[int]) -> list[Turn]:
    rng = random.Random(user)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    prev: tuple[list[int], list[int], str] | None = None
    for _ in range(rounds):
        messages.append({"role": "user", "content": _words(rng, rng.randint(20, 60))})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": rng.randint(40, 120),
            "temperature": 0,
            "stop_token_ids": stops,
            "return_token_ids": True,
        }
        out = _post(port, body)
        prompt_ids = list(out["prompt_token_ids"])
        choice = out["choices"][0]
        cached = int(((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if prev is not None:
            computed = prev[0] + prev[1][:-1]
            common = next((i for i, (a, b) in enumerate(zip(computed, prompt_ids)) if a != b), None)
            common = min(len(computed), len(prompt_ids)) if common is None else common
            diff = (computed[common], prompt_ids[common]) if common < len(computed) else None
            turns.append(Turn(len(computed), common, cached, len(prompt_ids), prev[2], diff))
        prev = (prompt_ids, list(choice["token_ids"]), str(choice["finish_reason"]))
        messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
    return turns


def _summary(turns: list[Turn]) -> dict[str, Any]:
    kept = [t for t in turns if t.common == t.computed_prev]
    by_finish: dict[str, list[int]] = {}
    for t in turns:
        by_finish.setdefault(t.prev_finish, [0, 0])
        by_finish[t.prev_finish][0] += 1
        by_finish[t.prev_finish][1] += t.common == t.computed_prev
    ideal = [min(t.common, t.prompt - 1) for t in turns]
    return {
        "follow_up_turns": len(turns),
        "kept_whole": len(kept),
        "kept_by_prev_finish": {k: f"{v[1]}/{v[0]}" for k, v in sorted(by_finish.items())},
        "first_diffs": sorted({t.first_diff for t in turns if t.first_diff is not None}),
        "mean_tokens_lost_to_template": sum(t.computed_prev - t.common for t in turns) / max(1, len(turns)),
        "cached_equals_common": sum(t.cached == i for t, i in zip(turns, ideal)),
        "mean_cached": sum(t.cached for t in turns) / max(1, len(turns)),
        "mean_computed_prev": sum(t.computed_prev for t in turns) / max(1, len(turns)),
        "turns": [asdict(t) for t in turns],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="every turn, not only the summary")
    args = ap.parse_args(argv)
    from kvpack.tools.tinymodel import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvpack-chat-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        template = Path(tmp) / "chat.jinja"
        template.write_text(TEMPLATE)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        # 40 words: ~2% a token; each is one token, so one id
        stops = [int(cast(int, tok.convert_tokens_to_ids(f"w{i}"))) for i in range(0, 2000, 50)]
        port = free_port()
        kv = {
            "kv_connector": "KVPackConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"disk": {"path": f"{tmp}/store"}},
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0", "--dtype", "float32",
            "--chat-template", str(template), "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        log = (Path(tmp) / "server.log").open("wb")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    sys.stderr.write((Path(tmp) / "server.log").read_text()[-4000:])
                    return 1
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except (OSError, http.client.HTTPException):  # not listening yet
                    time.sleep(1)
            system = _words(random.Random(-1), 150)
            with ThreadPoolExecutor(args.in_flight) as pool:
                futures = [
                    pool.submit(_conversation, port, str(model), u, args.rounds, system, stops)
                    for u in range(args.users)
                ]
                turns = [t for f in futures for t in f.result()]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    summary = _summary(turns)
    if not args.verbose:
        summary.pop("turns")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
