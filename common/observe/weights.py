"""Which weights computed a KV: noticing an in-place weight change and naming the new weights.

An object is loadable only by an engine holding the weights that computed it. The checkpoint an
engine starts on is named once, in the layout fingerprint (`kvpack.identity.model_identity`). Engines also
change weights in place while they run (RL rollouts, hot reloads: vLLM's ``reload_weights`` and its
weight-transfer API, SGLang's ``update_weights_from_*``). `WeightsWatch` notices such a change in
the process that holds the model, and `WeightsState` names what the engine holds since:

- `WeightsOrigin.CHECKPOINT`: the weights of the checkpoint the engine started on (identity ``""``;
  also after a reload of that very checkpoint): keys and objects exactly as before.
- `WeightsOrigin.RELOADED`: a whole local checkpoint loaded in place (vLLM's ``reload_weights`` from
  a path, SGLang's ``update_weights_from_disk``): named by that checkpoint's digest, so every engine
  that loads the same checkpoint in place shares again.
- `WeightsOrigin.PRIVATE`: anything else (tensors sent by a trainer, a partial load): named by the
  engine instance and the change's ordinal. No other engine shares them; said once in the log.

A non-empty identity is part of the layout's model (`with_weights`), so it is in the group
fingerprint that scopes every key and in every member fingerprint an object header carries and a
load checks: an object computed by other weights is never found, and one found is never loaded.

Invariants: `WeightsWatch.poll` is cheap (one pass over the parameters' version counters and
storage addresses; no device synchronisation, no bytes read) and is called once per engine step
before that step's loads and saves; a change's epoch is the number of polls that saw a change, so
every rank of one engine, polled in the same steps after the same weight updates, reaches the same
`WeightsState`. A write through ``tensor.data`` outside a watched loading method is not seen (torch
does not count it); every weight-loading path of vLLM and SGLang calls a watched method.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..identity.model_identity import IdentitySource, model_identity
from .metrics import Metrics

log = logging.getLogger("kvpack.observe.weights")

Signature = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]
"""(ids of the watched modules, ids of their parameter objects, per parameter its version
counter and storage address)."""

RELIST_EVERY = 64
"""Polls between two walks of the modules for their parameter objects. Between walks only the
listed parameters' version counters and storage addresses are read (walking a model's modules
costs far more per parameter than reading its counters: `kvpack bench weights`), so a parameter object
swapped for another outside every watched method is seen within this many steps."""


class WeightsOrigin(enum.Enum):
    """Where the weights an engine holds now came from."""

    CHECKPOINT = "checkpoint"
    RELOADED = "reloaded"
    PRIVATE = "private"


@dataclass(frozen=True)
class WeightsState:
    """What an engine computes with now.

    Attributes:
        epoch: how many weight changes were seen (0: none since start-up).
        identity: ``""`` for `WeightsOrigin.CHECKPOINT`, else ``ckpt:v1:<hex>`` (RELOADED)
            or ``private:<hex>`` (PRIVATE). Seeds every key's chain when non-empty.
        origin: how the identity was found.
    """

    epoch: int = 0
    identity: str = ""
    origin: WeightsOrigin = WeightsOrigin.CHECKPOINT

    def newer_than(self, other: WeightsState) -> bool:
        return self.epoch > other.epoch


STARTUP = WeightsState()
"""The weights of the checkpoint an engine started on."""


def with_weights(model: str, weights: str) -> str:
    """The layout's model field (`KVLayoutSpec.model`) of an engine started on checkpoint `model`
    that holds weights `weights` now (a `WeightsState.identity`; ``""``: the checkpoint's own, and
    `model` is returned unchanged, so objects of a checkpoint keep their keys)."""
    return f"{model}|weights={weights}" if weights else model


def private_identity(instance: str, epoch: int) -> str:
    """The identity of weights nobody can name: unique to one engine instance and change."""
    digest = hashlib.sha256(f"kvpack-private-weights\0{instance}\0{epoch}".encode()).hexdigest()
    return f"private:{digest[:32]}"


class WeightsWatch:
    """Notices in-place changes of one engine process's weights (module docstring).

    Two signals, either suffices: a call through a loading method installed by `watch_method`
    (the engines' every weight-loading path), and a changed parameter signature between two
    `poll`s (a parameter replaced, re-allocated, or written in place by a counted op).

    Args:
        instance: this engine's instance name, the same in every process of the engine
            (vLLM: ``VllmConfig.instance_id``); names PRIVATE weights.
        checkpoint: the start-up checkpoint's identity (`model_identity`'s value); a reload of
            a checkpoint with this identity is `WeightsOrigin.CHECKPOINT` again.
        modules: returns the modules whose parameters are the engine's weights (target and
            draft models); asked at every poll, so a model object replaced is followed.
        metrics: where a change is counted (``kvpack_weight_changes{origin}``).
    """

    def __init__(
        self,
        instance: str,
        checkpoint: str,
        modules: Callable[[], Sequence[torch.nn.Module]],
        metrics: Metrics | None = None,
    ) -> None:
        self.instance = instance
        self._metrics = metrics
        self.checkpoint = checkpoint
        self._modules = modules
        self._lock = threading.Lock()
        self._state = STARTUP
        self._loads = 0
        """Calls through watched methods since the last poll."""
        self._reloaded: str | None = None
        """The identity of a whole checkpoint loaded since the last poll (None: none, or a
        partial load came after it)."""
        self._depth = threading.local()
        self._module_ids: tuple[int, ...] = ()
        self._params: list[torch.Tensor] = []
        self._param_ids: tuple[int, ...] = ()
        self._polls = 0
        self._signature = self._sign()

    @property
    def state(self) -> WeightsState:
        return self._state

    # -- signals ------------------------------------------------------------------

    def watch_method(self, owner: object, name: str, checkpoint_of: Callable[..., str | None] | None = None) -> bool:
        """Wrap ``owner.<name>`` (a bound method, e.g. a model's ``load_weights``) so that each
        call counts as a weight change. `checkpoint_of(*args, **kwargs)`: the local checkpoint
        path the call loads whole, or None when it loads anything else. Idempotent per owner
        and name; False when `owner` has no such method."""
        method = getattr(owner, name, None)
        if not callable(method):
            return False
        if getattr(method, "__kvpack_watch__", None) is self:
            return True

        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            try:
                result = method(*args, **kwargs)
            except BaseException:
                self._note(None, outermost=depth == 0)  # some weights may be written: unnamed ones
                raise
            finally:
                self._depth.n = depth
            path = checkpoint_of(*args, **kwargs) if checkpoint_of is not None else None
            self._note(path, outermost=depth == 0)
            return result

        watched.__kvpack_watch__ = self  # type: ignore[attr-defined]
        object.__setattr__(owner, name, watched)
        return True

    def _note(self, checkpoint_path: str | None, outermost: bool) -> None:
        """A watched call returned: a whole checkpoint at `checkpoint_path`, or other weights.
        A nested call (``load_weights`` inside ``reload_weights``) is decided by its caller."""
        if not outermost and checkpoint_path is None:
            return
        identity = None
        if checkpoint_path is not None:
            try:
                named = model_identity(checkpoint_path)
            except (OSError, ValueError) as exc:
                log.warning("kvpack: cannot name the checkpoint loaded in place (%s); its weights stay private", exc)
            else:  # only a digest of what is on disk names weights; a name does not
                identity = named.value if named.source is IdentitySource.DIGEST else None
        with self._lock:
            self._loads += 1
            self._reloaded = identity

    def poll(self) -> WeightsState:
        """The weights now (once per engine step, before its loads and saves). A change since the
        last poll makes a new `WeightsState` (logged once); otherwise the same object."""
        signature = self._sign()
        with self._lock:
            loads, reloaded = self._loads, self._reloaded
            self._loads, self._reloaded = 0, None
            changed_tensors = signature != self._signature
            self._signature = signature
            if not loads and not changed_tensors:
                return self._state
            epoch = self._state.epoch + 1
            # a whole-checkpoint load may itself replace or rewrite parameters (vLLM's layerwise
            # reload re-materialises them): a changed signature beside it is that load's doing
            if loads and reloaded is not None:
                if reloaded == self.checkpoint:
                    state = WeightsState(epoch, "", WeightsOrigin.CHECKPOINT)
                else:
                    state = WeightsState(epoch, reloaded, WeightsOrigin.RELOADED)
            else:
                state = WeightsState(epoch, private_identity(self.instance, epoch), WeightsOrigin.PRIVATE)
            self._state = state
        if self._metrics is not None:
            self._metrics.inc("weight_changes", origin=state.origin.value)
        how = "a loading call" if loads else "changed parameter tensors"
        log.warning(
            "kvpack: this engine's weights changed in place (%s); from now on it loads and stores only KV of "
            "the new weights (%s%s)",
            how,
            state.origin.value,
            "" if not state.identity else f" {state.identity}",
        )
        if state.origin is WeightsOrigin.PRIVATE:
            log.warning(
                "kvpack: the new weights cannot be named (not a whole local checkpoint): this engine's cache "
                "entries are private to it until its weights are reloaded from a checkpoint"
            )
        return state

    def dropped_saves(self, pages: int) -> None:
        """Count `pages` an adapter did not store because the weights that computed them were
        since replaced (``kvpack_stale_weights_transfers{kind="save"}``)."""
        if self._metrics is not None and pages > 0:
            self._metrics.inc("stale_weights_transfers", float(pages), kind="save")

    def _sign(self) -> Signature:
        modules = self._modules()
        module_ids = tuple(map(id, modules))
        if module_ids != self._module_ids or self._polls % RELIST_EVERY == 0:
            self._module_ids = module_ids
            self._params = list(_parameters(modules))
            self._param_ids = tuple(map(id, self._params))
        self._polls += 1
        return (module_ids, self._param_ids, parameter_state(self._params))


def parameter_state(params: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Per tensor: its version counter (bumped by every in-place write torch counts) and storage
    address (changed when its storage is swapped, ``.data = ...``). No device sync, no bytes read."""
    return tuple((p._version, p.data_ptr()) for p in params)  # noqa: SLF001 (torch has no public accessor)


def _parameters(modules: Iterable[torch.nn.Module]) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p
