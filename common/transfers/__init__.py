"""Transfers between an engine's cache and the store: the runner and its jobs.

An adapter builds `LoadJob`s and `SaveJob`s from its engine's per-step facts and hands
them to one `TransferRunner` per process (or per worker); the runner runs them off the
forward path, in order, within bounded time and bounded host memory, and reports them
back (`Finished`, `TransferRunner.take_failed_blocks`, `TransferRunner.take_report`).
Copies go through `kvpack.transfers.staging` (pinned rows, side streams, events on a GPU).
"""

from .jobs import ByteBound, Finished, Gathered, LoadChunk, LoadJob, PlannedLoad, SaveJob
from .runner import IDLE_STEP_PAUSE_S, SYNC_SAVE_WAIT_S, TransferRunner
from .staging import CpuDevice, CudaDevice, Direction, Lane, Staged, Staging, StagingDevice, inline_lane

__all__ = [
    "ByteBound",
    "CpuDevice",
    "CudaDevice",
    "Direction",
    "Finished",
    "Gathered",
    "IDLE_STEP_PAUSE_S",
    "Lane",
    "LoadChunk",
    "LoadJob",
    "PlannedLoad",
    "SYNC_SAVE_WAIT_S",
    "SaveJob",
    "Staged",
    "Staging",
    "StagingDevice",
    "TransferRunner",
    "inline_lane",
]
