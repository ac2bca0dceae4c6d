"""Who owns ``trainer.default_local_dir``: one run at a time, and a fresh run never over an old one.

:func:`claim` takes an advisory lock (``fcntl.flock`` on ``<run_dir>/.run.lock``, which records the
holder's pid, host and start time) for as long as the trainer lives; a second run, in another
process, is refused with a message naming the holder. The OS drops the lock when its process ends,
so a killed run never blocks the next. Within one process the lock is shared (a resumed trainer
next to the one that trained, as in tests). ``resume_mode=disable`` into a directory that already
holds metrics or checkpoints is refused instead of overwriting them.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from typing import Callable, Dict, List

LOCK_FILE = ".run.lock"
# Locks this process holds: real path of the run directory -> [fd, holders].
_held: Dict[str, list] = {}


class RunDirectoryInUse(RuntimeError):
    """Another process holds the run directory's lock."""


def previous_run(run_dir: str) -> List[str]:
    """What of an earlier run ``run_dir`` holds: a non-empty ``metrics.jsonl``, checkpoint entries."""
    found = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    ckpts = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpts):
        found += [f"checkpoints/{name}" for name in sorted(os.listdir(ckpts))]
    return found


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "holder unknown"


def _release(key: str) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])  # closing the last descriptor drops the flock


def claim(run_dir: str, *, fresh: bool) -> Callable[[], None]:
    """Lock ``run_dir`` for this process; returns the function that releases it (idempotent).

    ``fresh`` (``resume_mode=disable``): refuse a directory holding an earlier run (ValueError naming
    the directory and the key). Another process holding the lock: :class:`RunDirectoryInUse`.
    """
    key = os.path.realpath(run_dir)
    found = previous_run(key) if fresh else []
    if found:
        raise ValueError(f"trainer.resume_mode=disable: trainer.default_local_dir {run_dir!r} already holds a run "
                         f"({', '.join(found[:4])}), which a fresh run would overwrite; pick another "
                         "trainer.default_local_dir, move that run away, or set trainer.resume_mode=auto to "
                         "continue it")
    if key not in _held:
        os.makedirs(key, exist_ok=True)
        fd = os.open(os.path.join(key, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirectoryInUse(
                f"trainer.default_local_dir {run_dir!r} is in use by another run ({holder}; lock file "
                f"{os.path.join(key, LOCK_FILE)}): two runs in one directory overwrite each other's checkpoints "
                "and metrics. Wait for it to finish, stop it, or pick another trainer.default_local_dir") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held[key] = [fd, 0]
    _held[key][1] += 1
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            _release(key)
    return release
