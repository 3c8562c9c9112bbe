"""The soak's workload: shared-prefix prompts from several tenants, and the client.

Prompts are token ids (exact lengths, exact block boundaries). Each tenant
reads a few documents (one public document every tenant reads, and private
ones), asking one of a few questions after each: ``doc + question``. A
follow-up turn continues a conversation: ``doc + question + the reference
reply + another question``, so reuse of stored generated tokens is exercised
too. Document lengths cover whole blocks and partial tails.

Every request is greedy (temperature 0, ``ignore_eos``, fixed
``max_tokens``) and streamed; `stream_completion` records the token ids, the
server's ``cached_tokens`` and the time of every streamed chunk, so the
longest gap between two tokens of a running request (an engine step that
waited) is measured from the client.

The client uses only the standard library (``http.client``) so the soak
needs nothing beyond kvpack and the engine.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

VOCAB_LO, VOCAB_HI = 3, 1999
"""Token ids the tiny test model's tokenizer knows (0-2 are special)."""


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(VOCAB_LO, VOCAB_HI) for _ in range(n))


@dataclass(frozen=True)
class Workload:
    """Every prompt the soak may send, by name, and which tenant reads which document."""

    tenants: tuple[str, ...]
    docs: dict[str, tuple[int, ...]]
    questions: tuple[tuple[int, ...], ...]
    tenant_docs: dict[str, tuple[str, ...]]
    followup_questions: tuple[tuple[int, ...], ...]
    extra: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Prompts of the fault and security events (canary, bomb, evictors...)."""

    @classmethod
    def build(
        cls,
        seed: int = 0,
        tenants: Sequence[str] = ("acme", "globex", "initech"),
        private_docs: int = 2,
        questions: int = 4,
        doc_lengths: Sequence[int] = (300, 384, 450, 600, 520, 256, 700),
        evictors: int = 0,
        evictor_len: int = 512,
    ) -> Workload:
        rng = random.Random(seed)
        docs: dict[str, tuple[int, ...]] = {}
        lengths = list(doc_lengths)
        docs["public"] = random_tokens(rng, lengths[0])
        tenant_docs: dict[str, tuple[str, ...]] = {}
        k = 1
        for t in tenants:
            names = ["public"]
            for j in range(private_docs):
                name = f"{t}-doc{j}"
                docs[name] = random_tokens(rng, lengths[k % len(lengths)])
                k += 1
                names.append(name)
            tenant_docs[t] = tuple(names)
        qs = tuple(random_tokens(rng, rng.randint(8, 40)) for _ in range(questions))
        fqs = tuple(random_tokens(rng, rng.randint(8, 24)) for _ in range(2))
        extra = {
            "canary": random_tokens(rng, 530),
            "planted": random_tokens(rng, 300),
            "bomb-mooncake": random_tokens(rng, 300),
            "bad-tenant": random_tokens(rng, 280),
        }
        for i in range(evictors):
            extra[f"evictor{i}"] = random_tokens(rng, evictor_len)
        return cls(tuple(tenants), docs, qs, tenant_docs, fqs, extra)

    def first_turn(self, doc: str, q: int) -> tuple[int, ...]:
        return self.docs[doc] + self.questions[q]

    def followup(self, doc: str, q: int, reply: Sequence[int], f: int) -> tuple[int, ...]:
        return self.first_turn(doc, q) + tuple(reply) + self.followup_questions[f]

    def first_turns(self) -> list[tuple[int, ...]]:
        return [self.first_turn(d, q) for d in self.docs for q in range(len(self.questions))]


@dataclass
class Result:
    """One request as the client saw it."""

    kind: str
    tenant: str
    prompt: tuple[int, ...]
    status: str = "ok"
    """ok, http_<code>, or error (the exception text is in `error`)."""
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    started: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    gaps: list[tuple[float, float]] = field(default_factory=list)
    """(previous chunk time, this chunk time) for every streamed chunk after the first."""

    @property
    def max_gap(self) -> float:
        return max((b - a for a, b in self.gaps), default=0.0)


def completion_body(
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    tenant: Any = None,
    cache_salt: Any = None,
    stream: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tenant is not None:
        body["kv_transfer_params"] = {"kvpack_tenant": tenant}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def stream_completion(
    port: int, body: dict[str, Any], result: Result, timeout_s: float = 60.0, host: str = "127.0.0.1"
) -> Result:
    """POST /v1/completions (streamed) and fill `result`. Never raises."""
    result.started = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.status = f"http_{resp.status}"
            result.error = resp.read(2000).decode(errors="replace")
            return result
        last = 0.0
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.monotonic()
            chunk = json.loads(data)
            if chunk.get("error"):
                result.status = "error"
                result.error = json.dumps(chunk["error"])[:2000]
                break
            usage = chunk.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = int(details.get("cached_tokens") or 0)
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if not ids:
                    continue
                result.tokens.extend(int(t) for t in ids)
                if not result.first_token:
                    result.first_token = now
                else:
                    result.gaps.append((last, now))
                last = now
    except Exception as exc:  # the soak counts a failure, it does not stop
        result.status = "error"
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.finished = time.monotonic()
        conn.close()
    return result
