"""KV computed by other weights is never loaded, and never stored under the old weights' name.

Real vLLM CPU engines, each in a process of its own, fp32, block 32, one disk store. Two
checkpoints of one architecture: A (the tiny model) and B (the same config rebuilt with
another seed: other weights). The weights change in place the ways RL loops and hot reloads
change them, and every output is compared with a no-cache engine started on the weights the
engine holds at that moment:

- ``reload_weights`` from B's path through ``collective_rpc`` (vLLM's default multi-process
  mode: the scheduler learns the change from the workers), then ``reset_prefix_cache()`` as RL
  frameworks call it. Objects of A are not loaded; what is stored from then on is under a
  fingerprint naming B's checkpoint digest, so a second engine that reloads B shares it.
- a trainer's tensors through ``model.load_weights`` (an RL worker extension's call), no reset:
  the new weights cannot be named, so the engine's entries become private to it.
- parameters written in place with ``copy_`` (no loading method at all): noticed from the
  parameters' version counters.
- the store is not poisoned: a fresh engine on the unchanged checkpoint A answers A's output for
  a prompt first computed after the updates, and still hits what A computed.

The no-cache references are the oracle, not a user's run: they run in the test's own process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import Run, close_llm, engine_process, make_llm, prompt, run, same_output

from fixtures.tiny_model import build_tiny_llama, copy_model

pytestmark = pytest.mark.vllm

BS = 32
P = prompt(5101, 301)
Q = prompt(5202, 333)
R = prompt(5303, 270)

RELOAD_B = "llm.collective_rpc('reload_weights', kwargs={{'weights_path': {path!r}}})\nllm.reset_prefix_cache()\n"
LOAD_B_TENSORS = (  # a trainer's tensors through vLLM's own API (in-process: the iterator is passed as is)
    "from safetensors.torch import load_file\n"
    "tensors = load_file({path!r})\n"
    "llm.collective_rpc('reload_weights', kwargs={{'weights_iterator': iter(tensors.items())}})\n"
)
WRITE_EMBEDDING = (  # one parameter written in place, through no loading method at all
    "import torch\n"
    "from safetensors.torch import load_file\n"
    "emb = load_file({path!r})['model.embed_tokens.weight']\n"
    "def put(self):\n"
    "    with torch.no_grad():\n"
    "        self.model_runner.model.model.embed_tokens.weight[: emb.shape[0]].copy_(emb)\n"
    "llm.collective_rpc(put)\n"
)


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("weights")
    a = copy_model(tiny_llama, root / "a")
    b = build_tiny_llama(root / "b", seed=1)  # same config, names and shapes; other weights
    return a, b


@pytest.fixture(scope="module")
def references(checkpoints: tuple[Path, Path]) -> dict[str, Run]:
    """No-cache runs (the oracle, in this process): ``A:P``... on an engine started on A,
    ``B:P``... on one started on B, and ``MIX:Q`` on B's engine once A's token embedding
    was written into it in place."""
    a, b = checkpoints
    out: dict[str, Run] = {}
    for name, path in (("A", a), ("B", b)):
        llm = make_llm(path, block_size=BS)
        try:
            out.update({f"{name}:{k}": run(llm, ids) for k, ids in (("P", P), ("Q", Q), ("R", R))})
            if name == "B":  # B's weights with A's token embedding, written in place after start-up
                exec(WRITE_EMBEDDING.format(path=str(a / "model.safetensors")), {"llm": llm})  # noqa: S102
                out["MIX:Q"] = run(llm, Q)
        finally:
            close_llm(llm)
    assert not same_output(out["A:P"], out["B:P"])  # the two checkpoints compute different outputs
    assert not same_output(out["MIX:Q"], out["B:Q"]) and not same_output(out["MIX:Q"], out["A:Q"])
    return out


def _extra(store: Path) -> dict[str, object]:
    return {"disk": {"path": str(store)}, "io_timeout_ms": 30000}  # a slow load on a busy machine is no miss


def test_reload_from_a_checkpoint_never_loads_the_old_weights_kv_and_shares_the_new_checkpoints(
    checkpoints: tuple[Path, Path], references: dict[str, Run], tmp_path: Path
) -> None:
    a, b = checkpoints
    store = tmp_path / "kv"
    reload_b = {"exec": RELOAD_B.format(path=str(b))}
    # vLLM's default multi-process mode: the scheduler-side connector learns the change from the workers
    runs = engine_process(
        a, _extra(store), {"P": P, "Q": Q}, tmp_path / "e1.log", block_size=BS, multiprocess=True,
        steps=["P", "P", reload_b, "P", "Q", "Q"],
    )  # fmt: skip
    assert runs["P"].cached == 0 and same_output(runs["P"], references["A:P"])
    assert runs["P#2"].cached == len(P) - 1  # A's own objects hit before the update
    # after the update: A's objects for P are not loaded; B's output exactly. (The scheduler planned
    # them before it learned of the change, so vLLM reports them as cached; the workers refused them.)
    assert same_output(runs["P#3"], references["B:P"]), (runs["P#3"], references["B:P"])
    assert "weights changed in place" in (tmp_path / "e1.log").read_text()
    assert same_output(runs["Q"], references["B:Q"]) and same_output(runs["Q#2"], references["B:Q"])
    assert runs["Q#2"].cached == len(Q) - 1  # the new weights' objects are stored and hit

    # a fresh engine on the unchanged checkpoint A: Q (stored by B's weights) is A's own output, P still hits
    fresh = engine_process(a, _extra(store), {"P": P, "Q": Q}, tmp_path / "e2.log", block_size=BS, steps=["Q", "P"])
    assert fresh["Q"].cached == 0 and same_output(fresh["Q"], references["A:Q"])
    assert fresh["P"].cached == len(P) - 1 and same_output(fresh["P"], references["A:P"])

    # another engine that reloads the same checkpoint B in place shares what the first stored for it
    other = engine_process(
        a, _extra(store), {"Q": Q, "R": R}, tmp_path / "e3.log", block_size=BS,
        steps=["R", reload_b, "R", "Q"],
    )  # fmt: skip
    assert same_output(other["R#2"], references["B:R"])  # the step the workers noticed the change in
    assert other["Q"].cached == len(Q) - 1 and same_output(other["Q"], references["B:Q"])


def test_tensors_from_a_trainer_and_in_place_writes_make_the_engines_entries_private(
    checkpoints: tuple[Path, Path], references: dict[str, Run], tmp_path: Path
) -> None:
    a, b = checkpoints
    store = tmp_path / "kv"
    load_b = {"exec": LOAD_B_TENSORS.format(path=str(b / "model.safetensors"))}
    write = {"exec": WRITE_EMBEDDING.format(path=str(a / "model.safetensors"))}
    runs = engine_process(
        a, _extra(store), {"P": P, "Q": Q}, tmp_path / "rl.log", block_size=BS,
        steps=["P", "P", load_b, "P", "Q", "Q", write, "Q", "Q", "Q"],
    )  # fmt: skip
    assert runs["P#2"].cached == len(P) - 1 and same_output(runs["P#2"], references["A:P"])
    # no reset, vLLM's prefix cache off: kvpack alone decides, and loads nothing of A's weights
    assert same_output(runs["P#3"], references["B:P"])
    assert runs["Q#2"].cached == len(Q) - 1 and same_output(runs["Q#2"], references["B:Q"])
    # one parameter written in place: nothing the previous weights computed is loaded, and the
    # entries of the weights now held are stored and hit again
    assert same_output(runs["Q#3"], references["MIX:Q"]) and same_output(runs["Q#4"], references["MIX:Q"])
    assert runs["Q#5"].cached == len(Q) - 1 and same_output(runs["Q#5"], references["MIX:Q"])

    # nothing the trainer's weights computed is loaded by an engine on checkpoint A
    fresh = engine_process(a, _extra(store), {"Q": Q}, tmp_path / "fresh.log", block_size=BS)
    assert fresh["Q"].cached == 0 and same_output(fresh["Q"], references["A:Q"])
