"""`kvpack.observe.weights`: an in-place weight change is noticed, whatever path made it, and named.

CPU-only, real torch modules and real checkpoint files (a config.json and a safetensors file
written here), table-style over the ways engines change weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpack import KVLayoutSpec, Metrics, WeightsOrigin, WeightsWatch, with_weights
from kvpack.identity.model_identity import model_identity
from kvpack.observe.weights import RELIST_EVERY, private_identity


class Model(torch.nn.Module):
    """A model with the engines' loading method: ``load_weights(iterable of (name, tensor))``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4, bias=False)
        self.b = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)  # as vLLM's loaders write: torch counts nothing


class Runner:
    """An engine's runner: reloads a whole checkpoint through the model's own loading method."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def reload_weights(self, path: str) -> None:
        self.model.load_weights([(n, torch.ones_like(p)) for n, p in self.model.named_parameters()])


def checkpoint(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["Model"], "hidden_size": 4}))
    torch.manual_seed(seed)
    save_file({"a.weight": torch.randn(4, 4), "b.weight": torch.randn(4, 4)}, str(root / "model.safetensors"))
    return root


@pytest.fixture
def engine(tmp_path: Path) -> tuple[Model, Runner, WeightsWatch, Metrics]:
    model = Model()
    runner = Runner(model)
    start = checkpoint(tmp_path / "start", seed=0)
    metrics = Metrics()
    watch = WeightsWatch("engine-1", model_identity(start).value, lambda: [model], metrics)
    watch.watch_method(model, "load_weights")
    watch.watch_method(runner, "reload_weights", lambda path: path)
    return model, runner, watch, metrics


def test_nothing_changes_without_a_change(engine: tuple[Model, Runner, WeightsWatch, Metrics]) -> None:
    model, _, watch, _ = engine
    first = watch.poll()
    for _ in range(2 * RELIST_EVERY):
        with torch.no_grad():
            model(torch.ones(1, 4))  # forwards write no parameter
        assert watch.poll() is first
    assert first.epoch == 0 and first.identity == "" and first.origin is WeightsOrigin.CHECKPOINT


WRITES: dict[str, Callable[[Model], None]] = {
    "load_weights (a trainer's tensors)": lambda m: m.load_weights([("a.weight", torch.zeros(4, 4))]),
    "copy_ under no_grad": lambda m: _no_grad(lambda: m.a.weight.copy_(torch.zeros(4, 4))),
    "storage swapped (.data =)": lambda m: setattr(m.b.weight, "data", torch.zeros(4, 4)),
}


def _no_grad(f: Callable[[], object]) -> None:
    with torch.no_grad():
        f()


@pytest.mark.parametrize("how", list(WRITES))
def test_any_write_makes_private_weights_named_alike_on_every_rank(
    how: str, engine: tuple[Model, Runner, WeightsWatch, Metrics]
) -> None:
    model, _, watch, metrics = engine
    WRITES[how](model)
    state = watch.poll()
    assert state.epoch == 1 and state.origin is WeightsOrigin.PRIVATE
    assert state.identity == private_identity("engine-1", 1)  # what every rank of the engine computes
    assert state.identity != private_identity("engine-2", 1)  # never another engine's
    assert watch.poll() is state  # seen once
    assert metrics.snapshot()["weight_changes"] == {"origin=private": 1.0}


def test_a_parameter_object_replaced_outside_any_method_is_seen_within_the_relist_bound(
    engine: tuple[Model, Runner, WeightsWatch, Metrics],
) -> None:
    model, _, watch, _ = engine
    watch.poll()
    model.a.weight = torch.nn.Parameter(torch.zeros(4, 4))
    epochs = [watch.poll().epoch for _ in range(RELIST_EVERY)]
    assert epochs[-1] == 1, epochs


def test_a_whole_checkpoint_reloaded_is_named_by_its_digest_and_the_start_checkpoint_by_nothing(
    engine: tuple[Model, Runner, WeightsWatch, Metrics], tmp_path: Path
) -> None:
    _, runner, watch, _ = engine
    other = checkpoint(tmp_path / "other", seed=1)
    runner.reload_weights(str(other))  # its nested load_weights is the reload's own doing
    state = watch.poll()
    assert state.origin is WeightsOrigin.RELOADED and state.identity == model_identity(other).value
    runner.reload_weights(str(tmp_path / "start"))
    back = watch.poll()
    assert back.epoch == 2 and back.origin is WeightsOrigin.CHECKPOINT and back.identity == ""


def test_a_reload_then_a_partial_load_before_the_next_step_is_private(
    engine: tuple[Model, Runner, WeightsWatch, Metrics], tmp_path: Path
) -> None:
    model, runner, watch, _ = engine
    runner.reload_weights(str(checkpoint(tmp_path / "other", seed=1)))
    model.load_weights([("b.weight", torch.zeros(4, 4))])
    assert watch.poll().origin is WeightsOrigin.PRIVATE


def test_a_load_that_fails_half_way_leaves_unnamed_weights(
    engine: tuple[Model, Runner, WeightsWatch, Metrics], tmp_path: Path
) -> None:
    model, _, watch, _ = engine
    with pytest.raises(KeyError):
        model.load_weights([("a.weight", torch.zeros(4, 4)), ("no.such.weight", torch.zeros(4, 4))])
    assert watch.poll().origin is WeightsOrigin.PRIVATE


def test_a_path_that_is_not_a_local_checkpoint_names_nothing(
    engine: tuple[Model, Runner, WeightsWatch, Metrics],
) -> None:
    _, runner, watch, _ = engine
    runner.reload_weights("org/some-hub-model")  # a name is not what the weights are
    assert watch.poll().origin is WeightsOrigin.PRIVATE


def test_weights_are_in_every_fingerprint_and_the_start_checkpoint_keeps_its_own() -> None:
    def spec(model: str) -> KVLayoutSpec:
        return KVLayoutSpec(engine="vllm:cpu", model=model, dtype="float32", chunk_tokens=16)

    start = spec("ckpt:v1:aa")
    assert spec(with_weights("ckpt:v1:aa", "")) == start  # objects of the start-up checkpoint keep their keys
    private = spec(with_weights("ckpt:v1:aa", private_identity("engine-1", 1)))
    reloaded = spec(with_weights("ckpt:v1:aa", "ckpt:v1:bb"))
    fingerprints = {s.group_fingerprint for s in (start, private, reloaded)}
    assert len(fingerprints) == 3
    assert len({s.member_fingerprint for s in (start, private, reloaded)}) == 3
