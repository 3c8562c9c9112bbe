"""The worker's weights, watched: vLLM's model and drafter handed to the core's `kvpack.WeightsWatch`.

vLLM changes a live worker's weights through ``Worker.reload_weights`` -> ``GPUModelRunner.reload_weights``
(from a checkpoint on disk, or from tensors), through its weight-transfer engines
(``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, also for the drafter),
through RL frameworks' worker extensions that call ``model.load_weights`` via ``collective_rpc``,
and through sleep mode level 2 followed by one of those. Each of them ends in the model's (or the
drafter's) ``load_weights`` or writes the parameters, so the watch wraps those two methods and the
runner's ``reload_weights`` (which says whether a whole local checkpoint was loaded, and from where),
and compares the parameters' signature once per step. None of this changes what vLLM does.

The connector is never handed the model: it is the runner that registers the KV caches, found on
the call stack of `register_kv_caches` (``GPUModelRunner.initialize_kv_cache``; the CPU runner
inherits it).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from kvpack import KVPackConfig, Metrics, WeightsState, WeightsWatch

from .scopes import target_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")

_MAX_FRAMES = 8
"""How far up the stack of `register_kv_caches` the model runner is looked for."""


def find_model_runner() -> Any | None:
    """The model runner registering the KV caches (the caller's caller's ... ``self`` with a
    ``get_model`` method and a ``kv_caches`` list), or None."""
    frame = inspect.currentframe()
    for _ in range(_MAX_FRAMES):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and callable(getattr(owner, "get_model", None)) and hasattr(owner, "kv_caches"):
            return owner
    return None


def _models(runner: Any) -> list[torch.nn.Module]:
    """The target model and, with speculative decoding, the drafter's own model."""
    out: list[torch.nn.Module] = []
    try:
        model = runner.get_model()
    except (AttributeError, ValueError):
        model = None
    if isinstance(model, torch.nn.Module):
        out.append(model)
    draft = getattr(getattr(runner, "drafter", None), "model", None)
    if isinstance(draft, torch.nn.Module) and all(draft is not m for m in out):
        out.append(draft)
    return out


class EngineWeights:
    """One worker's `WeightsWatch` over its runner's models (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, checkpoint: str, runner: Any, metrics: Metrics) -> None:
        self.runner = runner
        self.watch = WeightsWatch(str(vllm_config.instance_id), checkpoint, lambda: _models(runner), metrics)
        self._watched: list[torch.nn.Module] = []
        self.watch.watch_method(runner, "reload_weights", self._reloaded_checkpoint)
        self._follow(_models(runner))

    def _reloaded_checkpoint(
        self,
        weights_iterator: Iterable[Any] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
        *args: Any,
        **kwargs: Any,
    ) -> str | None:
        """After ``reload_weights`` returned: the local checkpoint it loaded whole (vLLM points
        ``model_config.model`` at `weights_path` when one is given), or None for tensors."""
        if weights_iterator is not None or not is_checkpoint_format:
            return None
        return str(self.runner.vllm_config.model_config.model)

    def _follow(self, models: list[torch.nn.Module]) -> None:
        """Wrap ``load_weights`` of every model not wrapped yet (a model object vLLM replaced)."""
        for model in models:
            if all(model is not m for m in self._watched):
                self.watch.watch_method(model, "load_weights")
                self._watched.append(model)

    def poll(self) -> WeightsState:
        """The worker's `kvpack.WeightsState` now (once per step, before its loads and saves)."""
        self._follow(_models(self.runner))
        return self.watch.poll()


def watch_weights(vllm_config: VllmConfig, config: KVPackConfig, metrics: Metrics) -> EngineWeights | None:
    """The watch of this worker's weights (the start-up checkpoint named by `scopes.target_identity`),
    or None (logged once) when its runner cannot be found: then an in-place weight update goes
    unnoticed, as the warning says."""
    runner = find_model_runner()
    if runner is None:
        log.warning(
            "kvpack: cannot find this worker's model runner (a vLLM version kvpack does not support?); an "
            "in-place weight update (reload_weights, update_weights) will not be noticed by kvpack"
        )
        return None
    return EngineWeights(vllm_config, target_identity(vllm_config, config), runner, metrics)
