"""Who owns ``trainer.default_local_dir``: one run at a time, and a fresh run never over an old one.

:func:`claim` takes an advisory lock (``fcntl.flock`` on ``<run_dir>/.run.lock``, which records the
holder's pid, host and start time) for as long as the trainer lives; a second run, in another
process, is refused with a message naming the holder. The OS drops the lock when its process ends,
so a killed run never blocks the next. Within one process the lock is shared (a resumed trainer
next to the one that trained, as in tests). ``resume_mode=disable`` into a directory that already
holds metrics or checkpoints is refused instead of overwriting them. :func:`check_checkpoint_dir`, at
start-up, refuses a path that cannot be written (a file or a dangling symbolic link in it, no permission).
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


def check_checkpoint_dir(path: str, key: str) -> None:
    """Start-up check that checkpoints can be written under ``path`` (named ``key`` in errors): no
    existing part of it is a file, and the nearest existing directory is writable."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{key} must be a directory path, got {path!r}")
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:  # up to the nearest existing part
        if os.path.islink(p):
            raise ValueError(f"{key}: {p!r} is a symbolic link to {os.readlink(p)!r}, which does not exist; "
                             f"checkpoints are written under {os.fspath(path)!r} (create the link's target "
                             "directory, remove the link, or pick another path)")
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ValueError(f"{key}: {p!r} is a file; checkpoints are written to the directory "
                         f"{os.fspath(path)!r} (pick another path or remove the file)")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: the directory {p!r} is not writable; checkpoints go to {os.fspath(path)!r}")


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
