"""Reading Linux's ``/proc/PID/stat`` (and ``/proc/PID/task/TID/stat``) files."""

from __future__ import annotations

import os


def stat_fields(path: str | os.PathLike[str]) -> list[str] | None:
    """The fields of a stat file after the process name, the state (field 3) first: the name is
    cut at the last ")" since it may itself hold spaces and parentheses. None when the file cannot
    be read (the process or thread is gone, or this is not Linux)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
