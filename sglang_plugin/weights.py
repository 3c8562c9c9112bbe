"""SGLang's in-place weight updates, noticed by the storage backend (`kvpack.WeightsWatch`).

SGLang changes a running server's weights with ``update_weights_from_disk``,
``update_weights_from_tensor``, ``update_weights_from_distributed`` and
``update_weights_from_ipc``; each flushes SGLang's own radix tree, none the L3 store. The
backend lives in the scheduler process of each TP rank, beside that rank's model runners, so
it watches them itself:

- Where: SGLang builds the backend on the scheduler's thread, from its HiCache controller,
  while the scheduler is being built or attaches storage at run time; both are on the call
  stack then (`WeightUpdates.find`). The scheduler gives the model runners SGLang updates
  (``tp_worker.weight_update_runners()`` and the draft worker's); a process-wide search for
  the one scheduler is the fallback.
- What: every runner's ``weight_updater`` is wrapped (`_WatchedUpdater`: its four update
  methods are watched; a disk update that succeeded, of a whole checkpoint, names that
  checkpoint, so its digest names the weights) and every model's ``load_weights`` is watched;
  the parameters' signature is compared at each poll (`kvpack.WeightsWatch`).
- When: the backend polls at the start of each of its calls. On a change it rescopes its
  keys (`kvpack.with_weights` of the model identity: every group and member
  fingerprint changes, so nothing of other weights is found or accepted).
- Saves between a change and SGLang's next cache flush are dropped (`saves_held`): pages
  SGLang queued for backup before the update were computed by the old weights, and the
  flush (``HiCacheController.reset``, watched) is what empties that queue. After it, every
  page handed for saving was computed by the weights held.

Invariant: found nothing to watch (a backend built outside a scheduler), the backend keeps
the start-up identity and says so once at info level.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from kvpack import Metrics, WeightsState, WeightsWatch, identify_model

log = logging.getLogger("kvpack.sglang")

UPDATE_METHODS = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "load_weights_from_distributed",
    "update_weights_from_ipc",
)
"""The model runner's ``weight_updater`` methods that change its weights (SGLang 0.5.23)."""


class _WatchedUpdater:
    """A model runner's ``weight_updater`` (SGLang's frozen, slotted ``WeightUpdater``, whose
    methods cannot be replaced on the instance) behind a stand-in with watched methods; every
    other attribute is the wrapped one's."""

    def __init__(self, inner: Any) -> None:
        self._kvpack_inner = inner
        self.loaded_checkpoint: str | None = None
        """The checkpoint path the last ``update_weights_from_disk`` loaded whole (None:
        it failed, or loaded a filtered part)."""

    def __getattr__(self, name: str) -> Any:
        if name == "_kvpack_inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._kvpack_inner, name)

    def update_weights_from_disk(self, model_path: str, *args: Any, **kwargs: Any) -> Any:
        self.loaded_checkpoint = None
        result = self._kvpack_inner.update_weights_from_disk(model_path, *args, **kwargs)
        whole = kwargs.get("weight_name_filter") is None and (len(args) < 2 or args[1] is None)
        ok = bool(result[0]) if isinstance(result, tuple) and result else False
        self.loaded_checkpoint = str(model_path) if ok and whole else None
        return result


def _instance() -> str:
    """This SGLang server's name, the same in every TP rank's scheduler (their parent process),
    unique per launch (its start time); a random one where the parent cannot be read."""
    try:
        import psutil

        ppid = os.getppid()
        return f"sglang:{socket.gethostname()}:{ppid}:{psutil.Process(ppid).create_time()}"
    except Exception:
        return f"sglang:{uuid.uuid4()}"


def _is_scheduler(obj: Any) -> bool:
    return callable(getattr(getattr(obj, "tp_worker", None), "weight_update_runners", None))


def _is_controller(obj: Any) -> bool:
    try:
        from sglang.srt.managers.cache_controller import HiCacheController
    except Exception:  # pragma: no cover - SGLang without it: no controller to watch
        return False
    return isinstance(obj, HiCacheController)


class WeightUpdates:
    """The weights one SGLang scheduler process computes with (module docstring).

    Args:
        scheduler: SGLang's scheduler (``tp_worker``, ``draft_worker``).
        controller: its HiCache controller (None: found later through the scheduler's tree
            cache, or never: saves are then never held).
        on_change: called with the new `WeightsState` under this object's lock, before the
            call that noticed the change goes on.
        metrics: where changes and dropped saves are counted.
    """

    def __init__(
        self,
        scheduler: Any,
        controller: Any,
        on_change: Callable[[WeightsState], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._controller = controller
        self._on_change = on_change
        self._lock = threading.RLock()
        self._held = False
        self._models: dict[int, int] = {}
        """id(runner) -> id(its model) whose ``load_weights`` is watched."""
        runners = self.runners()
        path = str(getattr(getattr(runners[0], "model_config", None), "model_path", "") or "") if runners else ""
        self.watch = WeightsWatch(_instance(), _startup_identity(path), self.modules, metrics)
        self._install()

    @classmethod
    def find(cls, on_change: Callable[[WeightsState], None], metrics: Metrics | None = None) -> WeightUpdates | None:
        """The scheduler (and HiCache controller) building this backend, from the call stack,
        else the one scheduler of this process; None (said once) when there is none."""
        scheduler = controller = None
        here = inspect.currentframe()
        frame = here.f_back if here is not None else None
        while frame is not None and (scheduler is None or controller is None):
            owner = frame.f_locals.get("self")
            if scheduler is None and _is_scheduler(owner):
                scheduler = owner
            elif controller is None and _is_controller(owner):
                controller = owner
            frame = frame.f_back
        module = sys.modules.get("sglang.srt.managers.scheduler")
        if scheduler is None and module is not None:  # not built by a scheduler's thread: the one scheduler here
            kind = getattr(module, "Scheduler", None)
            found = [o for o in gc.get_objects() if isinstance(kind, type) and isinstance(o, kind)]
            scheduler = found[0] if len(found) == 1 and _is_scheduler(found[0]) else None
        if scheduler is None:
            log.info("kvpack: no SGLang scheduler in this process: in-place weight updates are not watched")
            return None
        return cls(scheduler, controller, on_change, metrics)

    # -- what is watched ------------------------------------------------------------

    def runners(self) -> list[Any]:
        """The model runners SGLang's weight updates apply to (target, then drafts)."""
        out: list[Any] = []
        for worker in (getattr(self.scheduler, "tp_worker", None), getattr(self.scheduler, "draft_worker", None)):
            pairs = getattr(worker, "weight_update_runners", None)
            if callable(pairs):
                out.extend(runner for _role, runner in pairs())
        return out

    def modules(self) -> list[torch.nn.Module]:
        return [m for r in self.runners() if isinstance(m := getattr(r, "model", None), torch.nn.Module)]

    def _install(self) -> None:
        """Watch every runner's updater and model (again where SGLang replaced one)."""
        for runner in self.runners():
            updater = getattr(runner, "weight_updater", None)
            if updater is not None and not isinstance(updater, _WatchedUpdater):
                watched = _WatchedUpdater(updater)
                for name in UPDATE_METHODS:
                    checkpoint = (lambda *_a, w=watched, **_k: w.loaded_checkpoint) if "disk" in name else None
                    self.watch.watch_method(watched, name, checkpoint)
                runner.weight_updater = watched
            model = getattr(runner, "model", None)
            if model is not None and self._models.get(id(runner)) != id(model):
                self.watch.watch_method(model, "load_weights")
                self._models[id(runner)] = id(model)
        controller = self._controller or getattr(getattr(self.scheduler, "tree_cache", None), "cache_controller", None)
        if controller is not None and getattr(getattr(controller, "reset", None), "__kvpack_reset__", None) is not self:
            self._controller = controller
            self._watch_reset(controller)

    def _watch_reset(self, controller: Any) -> None:
        reset = controller.reset

        @functools.wraps(reset)
        def watched(*args: Any, **kwargs: Any) -> Any:
            result = reset(*args, **kwargs)
            with self._lock:
                self.poll()
                if self._held:
                    log.info("kvpack: SGLang flushed its cache after the weight update: saves resume")
                self._held = False
            return result

        watched.__kvpack_reset__ = self  # type: ignore[attr-defined]
        controller.reset = watched

    # -- polling ----------------------------------------------------------------------

    @property
    def state(self) -> WeightsState:
        return self.watch.state

    @property
    def saves_held(self) -> bool:
        """Saves are dropped: the weights changed and SGLang has not flushed its cache since."""
        return self._held

    def poll(self) -> WeightsState:
        """The weights now (at the start of each backend call); a change is handed to
        `on_change` and holds saves until SGLang's next cache flush."""
        with self._lock:
            self._install()
            before = self.watch.state
            state = self.watch.poll()
            if state is not before:
                self._on_change(state)
                if self._controller is not None:
                    self._held = True
            return state

    def saves_dropped(self, pages: int) -> bool:
        """Poll (`poll`); whether a save of `pages` pages is to be dropped now (`saves_held`),
        counted as dropped then."""
        self.poll()
        if not self._held:
            return False
        self.watch.dropped_saves(pages)
        return True


def _startup_identity(path: str) -> str:
    """The start-up checkpoint's identity (a reload of it is the start-up weights again)."""
    if not path:
        return ""
    try:
        return identify_model(path).value
    except (OSError, ValueError):
        return ""
