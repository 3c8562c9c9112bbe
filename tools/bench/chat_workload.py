"""The chat bench's pure parts: workloads, the messages each turn sends, report maths, the plot.

Nothing here starts a server or imports vLLM. Texts are words of the tiny
models' word-level vocabulary (``w0`` .. ``w1999``, `kvpack.tools.tinymodel`),
so one word is one token and a prompt's length is known without a tokenizer.

Invariants: a plan is a pure function of its shape and seed (same seed, same
turns, same texts, same order); TTFTs are seconds; a round is 1-based.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvpack.tools.bench.prom import percentile

VOCAB = 2000
"""Words ``w0`` .. ``w1999``; the template's role words are the last four, never drawn for texts."""
TEXT_WORDS = VOCAB - 4

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w1996 {{ m['content'] }} </s> "
    "{% elif m['role'] == 'user' %}w1997 {{ m['content'] }} </s> "
    "{% else %}w1998 {{ m['content'] }} </s> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}w1998 {% endif %}"
)
"""A plain Jinja chat template: a role word before each message, ``</s>`` after it, the
assistant's role word to open the answer (the tiny models ship no template)."""


@dataclass(frozen=True)
class ChatShape:
    """Users sharing one system prompt, each with a context of its own, `rounds` turns each."""

    users: int
    rounds: int
    system_words: int
    context_words: int
    question_words: int
    answer_min: int
    answer_max: int
    """Each turn's max_tokens is drawn in [answer_min, answer_max] (the answer's length)."""
    concurrency: int

    def conversation_tokens(self) -> int:
        """Upper bound on one user's last prompt plus answer, in tokens (words + role words)."""
        turns = self.rounds * (self.question_words + self.answer_max + 6)
        return self.system_words + self.context_words + turns + 8

    def total_tokens(self) -> int:
        """Distinct tokens of every conversation at its end (the shared system prompt counted once)."""
        return self.system_words + self.users * (self.conversation_tokens() - self.system_words)

    def resident(self) -> int:
        """Conversations the engine's KV cache must hold at once: every user in flight."""
        return self.concurrency


@dataclass(frozen=True)
class DocShape:
    """A few long documents: each read once (round 1), then queried again in random order (round 2)."""

    docs: int
    doc_words: int
    queries: int
    """Queries per document in round 2."""
    question_words: int
    answer_len: int
    concurrency: int

    def conversation_tokens(self) -> int:
        return 16 + self.doc_words + self.question_words + self.answer_len

    def total_tokens(self) -> int:
        return self.docs * self.conversation_tokens()

    def resident(self) -> int:
        """Two documents at once (queries in flight on one document share its blocks; more wait)."""
        return min(2, self.docs)


@dataclass(frozen=True)
class Turn:
    conv: int
    """The user (chat) or the document (longdoc)."""
    round: int
    question: str
    max_tokens: int


@dataclass(frozen=True)
class Plan:
    """Turns by round, each round's turns in sending order."""

    system: str
    openings: tuple[str, ...]
    """Per conversation, what its first user message starts with (the user's context, or the document)."""
    keep_history: bool
    """Chat: a turn sends every earlier turn and answer. Longdoc: each query stands alone."""
    rounds: tuple[tuple[Turn, ...], ...]

    def messages(self, turn: Turn, history: list[tuple[str, str]]) -> list[dict[str, str]]:
        """The chat messages `turn` sends, given its conversation's earlier (question, answer) pairs."""
        out = [{"role": "system", "content": self.system}]
        past = history if self.keep_history else []
        for i, (q, a) in enumerate(past):
            out.append({"role": "user", "content": f"{self.openings[turn.conv]} {q}" if i == 0 else q})
            out.append({"role": "assistant", "content": a})
        first = not past
        content = f"{self.openings[turn.conv]} {turn.question}" if first else turn.question
        out.append({"role": "user", "content": content})
        return out


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, TEXT_WORDS)}" for _ in range(n))


def chat_plan(shape: ChatShape, seed: int) -> Plan:
    rng = random.Random(seed)
    system = words(rng, shape.system_words)
    contexts = tuple(words(rng, shape.context_words) for _ in range(shape.users))
    rounds = []
    for r in range(1, shape.rounds + 1):
        order = list(range(shape.users))
        rng.shuffle(order)
        turns = tuple(
            Turn(u, r, words(rng, shape.question_words), rng.randint(shape.answer_min, shape.answer_max)) for u in order
        )
        rounds.append(turns)
    return Plan(system, contexts, True, tuple(rounds))


def longdoc_plan(shape: DocShape, seed: int) -> Plan:
    rng = random.Random(seed)
    system = words(rng, 8)
    docs = tuple(words(rng, shape.doc_words) for _ in range(shape.docs))
    first = tuple(Turn(d, 1, words(rng, shape.question_words), shape.answer_len) for d in range(shape.docs))
    again = [Turn(d, 2, words(rng, shape.question_words), shape.answer_len) for d in range(shape.docs)]
    again = [t for t in again for _ in range(shape.queries)]
    again = [Turn(t.conv, 2, words(rng, shape.question_words), t.max_tokens) for t in again]
    rng.shuffle(again)
    return Plan(system, docs, False, (first, tuple(again)))


_WORD = re.compile(r"w\d+|\S+")


def normalize_answer(text: str) -> str:
    """An answer as the client sends it back: its words, one space apart (streamed deltas of a
    word-level tokenizer may lack the spaces between words)."""
    return " ".join(_WORD.findall(text))


@dataclass(frozen=True)
class Result:
    conv: int
    round: int
    ttft_s: float
    prompt_tokens: int
    answer: str
    error: str = ""


@dataclass(frozen=True)
class RoundStats:
    round: int
    n: int
    mean_s: float
    p50_s: float
    p90_s: float


def round_stats(results: list[Result]) -> list[RoundStats]:
    """TTFT mean, p50 and p90 per round over the turns that answered, rounds ascending."""
    by: dict[int, list[float]] = {}
    for r in results:
        if not r.error:
            by.setdefault(r.round, []).append(r.ttft_s)
    out = []
    for rnd in sorted(by):
        v = by[rnd]
        out.append(RoundStats(rnd, len(v), sum(v) / len(v), percentile(v, 50), percentile(v, 90)))
    return out


def mean_from_round(results: list[Result], first_round: int = 2) -> float:
    """Mean TTFT over every answered turn of round `first_round` on (nan when none)."""
    v = [r.ttft_s for r in results if not r.error and r.round >= first_round]
    return sum(v) / len(v) if v else float("nan")


def answers_equal(results: list[Result], reference: list[Result]) -> tuple[int, int]:
    """(turns whose answer equals the reference run's same turn, turns compared); both lists are in
    plan order (round by round, each round's sending order), a failed turn never equal."""
    pairs = list(zip(results, reference))
    same = sum(1 for a, b in pairs if not a.error and not b.error and a.answer == b.answer)
    return same, len(pairs)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else float("nan")


@dataclass
class SetupRun:
    """One set-up's results, and what its server's counters say about where prompt tokens came from."""

    name: str
    results: list[Result] = field(default_factory=list)
    tiers: dict[str, float] = field(default_factory=dict)
    """Prompt tokens by source over the run: ``vLLM prefix cache``, ``external``, ``kvpack <tier>``."""
    accept: list[float] = field(default_factory=list)
    """Per round, accepted / drafted tokens (speculative decoding only)."""
    skipped: str = ""


def plot(path: str | Path, runs: list[SetupRun], title: str) -> None:
    """TTFT mean per round, one line per set-up (p50..p90 as a band), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for run in runs:
        stats = round_stats(run.results)
        if not stats:
            continue
        xs = [s.round for s in stats]
        (line,) = ax.plot(xs, [s.mean_s for s in stats], marker="o", label=run.name)
        ax.fill_between(xs, [s.p50_s for s in stats], [s.p90_s for s in stats], color=line.get_color(), alpha=0.12)
        ax.set_xticks(xs)
    ax.set_xlabel("round")
    ax.set_ylabel("TTFT, mean (s); band p50-p90")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    plt.close(fig)
