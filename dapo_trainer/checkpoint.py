"""Checkpoints that a killed run resumes from exactly, written and read without pickle.

Layout under ``<trainer.default_local_dir>/checkpoints``::

    global_step_N/model/                      HF safetensors + config.json + tokenizer files (loadable anywhere)
    global_step_N/optim_rank{r}.safetensors   optimiser + LR schedule of rank r (its own TP / FSDP shard)
    global_step_N/state_rank{r}.safetensors   step, data cursor, the accumulator's carried-over groups, RNG states
    global_step_N/manifest.json               written last: step, save sequence number, world size and
                                              parallel layout, every file's size and sha256
    latest_checkpointed_iteration.txt         N (verl's name; for tools, auto-resume does not need it)

State files are :mod:`dapo_trainer.state_file`'s (safetensors + a JSON header, never pickle); this
module is the directory protocol around them.

Crash safety. A save writes ``.global_step_N.tmp`` and its manifest, then renames it to
``global_step_N``; re-saving a step first renames the existing directory to
``.global_step_N.old`` and deletes it only once the new one is in place. A directory is
never deleted under its final name, so at every instant each step that had a complete
checkpoint still has one under one of its three names, and :func:`recover` (run by rank 0
before every save and every auto-resume) keeps the newest complete copy of each step as
``global_step_N`` and deletes the rest. "Complete" means a manifest whose files all exist
with their recorded sizes; "newest" is the manifest's save sequence number, so a later run
that re-saved lower steps (``resume_mode=resume_path``) wins over an earlier
run's higher steps, and a save killed before its manifest never wins over a finished one.

Integrity. The manifest records every file's sha256 (the save reads each file once to fsync it);
:func:`verify_checkpoint`, run at start-up before a resume builds its model, refuses a file whose
content changed since (bit rot, a partial copy of the same size, an edit), naming the file.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .state_file import FORMAT, load_state_file, save_state_file

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
_LAYOUT_KEYS = ("pp", "vpp", "dp", "tp", "sp", "ep")  # ParallelDims' sizes, outermost first
_STEP_DIR = re.compile(r"^\.?global_step_(\d+)(\.tmp|\.old)?$")
log = logging.getLogger(__name__)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- completeness, recovery
def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str, fsync: bool = False) -> str:
    """Hex sha256 of the file at ``path`` (``fsync``: flushed to disk first, in the same open)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, MANIFEST)) as f:
        return json.load(f)


def incomplete_reason(ckpt_dir: str) -> Optional[str]:
    """Why ``ckpt_dir`` is not a complete checkpoint, or None when it is."""
    if not os.path.isdir(ckpt_dir):
        return "no such directory"
    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        if any(f.endswith(".pt") for f in os.listdir(ckpt_dir)):
            return "pickled state (*.pt) from an older version: never loaded, since a pickle can run code"
        return f"no {MANIFEST}: its save did not finish"
    try:
        man = _read_manifest(ckpt_dir)
        files, step = dict(man["files"]), int(man["step"])
        int(man["sequence"])  # present and an integer: auto-resume orders checkpoints by it
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({e})"
    m = _STEP_DIR.match(os.path.basename(ckpt_dir))
    if m and int(m.group(1)) != step:
        return f"{MANIFEST} says step {step}"
    for name, size in files.items():
        p = os.path.join(ckpt_dir, name)
        if not os.path.isfile(p):
            return f"{name} is missing"
        if os.path.getsize(p) != size:
            return f"{name} has {os.path.getsize(p)} bytes, {MANIFEST} says {size}"
    return None


def _sequence(ckpt_dir: str) -> int:
    return int(_read_manifest(ckpt_dir)["sequence"])


def _rmtree(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)


def _fsync_dir(path: str) -> None:
    _fsync_file(path)  # makes renames inside ``path`` durable


def _settle(ckpt_root: str, step: int) -> None:
    """Make the newest complete copy of ``step`` its ``global_step_N`` and delete the others.

    Every operation is a rename or the deletion of a copy that is incomplete or has a newer
    complete copy elsewhere, so a kill between any two leaves a state this function settles.
    """
    final = os.path.join(ckpt_root, f"global_step_{step}")
    tmp = os.path.join(ckpt_root, f".global_step_{step}.tmp")
    old = os.path.join(ckpt_root, f".global_step_{step}.old")
    copies = [p for p in (final, tmp, old) if os.path.isdir(p)]
    complete = [p for p in copies if incomplete_reason(p) is None]
    best = max(complete, key=_sequence) if complete else None
    for p in copies:
        if p not in (best, final):
            _rmtree(p)
    if best is None or best == final:
        return
    aside = tmp if best == old else old  # removed above
    if os.path.isdir(final):
        os.replace(final, aside)  # the replaced copy stays whole until the new one is in place
    os.replace(best, final)
    _fsync_dir(ckpt_root)
    _rmtree(aside)


def recover(ckpt_root: str) -> None:
    """Finish or undo whatever a killed save left under ``ckpt_root`` (rank 0 only)."""
    if not os.path.isdir(ckpt_root):
        return
    steps = set()
    for name in os.listdir(ckpt_root):
        m = _STEP_DIR.match(name)
        if m and m.group(2):
            steps.add(int(m.group(1)))
        elif name.startswith(LATEST_FILE + ".tmp"):
            os.remove(os.path.join(ckpt_root, name))
    for step in sorted(steps):
        _settle(ckpt_root, step)


def _complete_checkpoints(ckpt_root: str):
    """(complete: [(sequence, step, dir)], skipped: [(dir, reason)]) over the ``global_step_N`` dirs."""
    complete, skipped = [], []
    if not os.path.isdir(ckpt_root):
        return complete, skipped
    for name in sorted(os.listdir(ckpt_root)):
        m = _STEP_DIR.match(name)
        if not m or m.group(2):
            continue
        d = os.path.join(ckpt_root, name)
        why = incomplete_reason(d)
        if why is None:
            complete.append((_sequence(d), int(m.group(1)), d))
        else:
            skipped.append((d, why))
    return complete, skipped


def checkpoints_in(path: str) -> list:
    """The ``global_step_N`` directory names directly under ``path``, by step ([] when none or no directory)."""
    if not os.path.isdir(path):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(path) if (m := _STEP_DIR.match(n)) and not m.group(2)]
    return [n for _, n in sorted(found)]


def _write_latest(ckpt_root: str, step: int) -> None:
    latest = os.path.join(ckpt_root, LATEST_FILE)
    tmp = f"{latest}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    _fsync_dir(ckpt_root)


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    """Directory of the newest complete checkpoint under ``ckpt_root``, or None (collective).

    Rank 0 first settles what a killed save left (:func:`recover`), then logs each
    checkpoint passed over and why, and points ``latest_checkpointed_iteration.txt`` at
    the one chosen.
    """
    if _rank() == 0:
        recover(ckpt_root)
    _barrier()
    complete, skipped = _complete_checkpoints(ckpt_root)
    best = max(complete) if complete else None
    if _rank() == 0:
        for d, why in skipped:
            log.warning("checkpoint %s skipped: %s", d, why)
        for seq, step, d in complete:
            if best and step > best[1]:
                log.warning("checkpoint %s skipped: saved before %s (save %d < %d: an earlier run)",
                            d, best[2], seq, best[0])
        if best:
            log.info("resuming from %s", best[2])
            latest = os.path.join(ckpt_root, LATEST_FILE)
            current = None
            if os.path.isfile(latest):
                with open(latest) as f:
                    current = f.read().strip()
            if current != str(best[1]):
                _write_latest(ckpt_root, best[1])
        elif skipped:
            log.warning("no complete checkpoint under %s: starting from step 0", ckpt_root)
    _barrier()
    return best[2] if best else None


# ---------------------------------------------------------------------- save / load
def _check_finite(step: int, full_state: dict) -> None:
    floats = [(k, v) for k, v in full_state.items() if v.is_floating_point()]
    if not floats:
        return
    ok = torch.stack([torch.isfinite(v).all() for _, v in floats]).cpu()  # one read per save
    if not bool(ok.all()):
        bad = [k for (k, _), good in zip(floats, ok.tolist()) if not good]
        raise RuntimeError(f"refusing to checkpoint step {step}: non-finite weights in {bad[:5]}"
                           f"{' ...' if len(bad) > 5 else ''}; the previous checkpoint is kept")


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written (disk full, quota, I/O error); names the file."""


@contextlib.contextmanager
def _writing(step: int, path: str, tmp: str):
    """A failure while writing ``path`` (an OSError, or safetensors' own error type, which is not
    public) is a :class:`CheckpointWriteError` naming the file and the directory; the partial save
    ``tmp`` is removed (it never replaces a complete checkpoint)."""
    try:
        yield
    except (TypeError, ValueError):  # the state itself is wrong: not a write failure
        raise
    except Exception as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        err = CheckpointWriteError(f"checkpoint of step {step}: writing {path!r} failed ({type(e).__name__}: {e}); "
                                   f"the partial save {tmp!r} is removed and the previous complete checkpoints "
                                   f"under {os.path.dirname(tmp)!r} are kept. Free space there (or pick another "
                                   "trainer.default_local_dir) and resume")
        err.errno = getattr(e, "errno", None)
        raise err from e


def layout_of(dims) -> dict:
    """The parallel sizes a checkpoint's per-rank files depend on (recorded in its manifest)."""
    return {k: getattr(dims, k) for k in _LAYOUT_KEYS}


def _fmt_layout(world, layout: Optional[dict]) -> str:
    procs = f"{world} process{'' if world == 1 else 'es'}"
    if not isinstance(layout, dict) or not layout:
        return procs
    return f"{procs}, {' x '.join(f'{k.upper()}={layout[k]}' for k in _LAYOUT_KEYS if k in layout)}"


def check_resume_layout(ckpt_dir: str, world: int, layout: dict) -> None:
    """Start-up check: ``ckpt_dir`` was saved by ``world`` processes in ``layout`` (its manifest's
    ``world_size`` / ``layout``; an older manifest without a layout: its world size only). Else a
    ValueError naming both and what does load at another layout: the HF ``model/`` directory."""
    man = _read_manifest(ckpt_dir)
    saved_world, saved_layout = man.get("world_size"), man.get("layout")
    if isinstance(saved_layout, dict):  # saved before expert parallelism existed: EP = 1
        saved_layout = {**saved_layout, "ep": saved_layout.get("ep", 1)}
    same_layout = not isinstance(saved_layout, dict) or saved_layout == layout
    if saved_world in (None, world) and same_layout:
        return
    raise ValueError(
        f"trainer.resume_mode: checkpoint {ckpt_dir!r} was saved by {_fmt_layout(saved_world, saved_layout)}; this "
        f"run has {_fmt_layout(world, layout)}. A resume restores each rank's optimiser shard, RNG and data cursor, "
        "so it needs the saved world size and parallel layout (actor_rollout_ref.actor.*_parallel_size): resume "
        "with those, or start a new run from the checkpoint's weights, which load at any layout "
        f"(actor_rollout_ref.model.path={os.path.join(ckpt_dir, 'model')}, trainer.resume_mode=disable, another "
        "trainer.default_local_dir; the optimiser state and data position start afresh)")


def save_checkpoint(ckpt_root: str, step: int, *, model, full_state: dict, optimizer, scheduler, trainer_state: dict,
                    model_src_dir: Optional[str] = None, layout: Optional[dict] = None) -> str:
    """Write ``global_step_{step}`` (collective: every rank calls it). Returns its path.

    ``full_state``: the unsharded model ``state_dict`` (every rank gathers it; rank 0 writes).
    ``trainer_state``: this rank's state (cursor, accumulator, step, ...): tensors, arrays,
    numbers, strings and containers of them. Non-finite weights are refused (RuntimeError)
    before anything is written. ``layout``: the parallel sizes, recorded for
    :func:`check_resume_layout`. A write that fails: :class:`CheckpointWriteError`.
    """
    from .hf_io import save_hf_model

    _check_finite(step, full_state)
    rank = _rank()
    final = os.path.join(ckpt_root, f"global_step_{step}")
    tmp = os.path.join(ckpt_root, f".global_step_{step}.tmp")
    if rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        recover(ckpt_root)
        with _writing(step, tmp, tmp):
            os.makedirs(tmp)
    _barrier()
    if rank == 0:
        with _writing(step, os.path.join(tmp, "model"), tmp):
            save_hf_model(model, os.path.join(tmp, "model"), state_dict=full_state)
            for name in _TOKENIZER_FILES:  # so the checkpoint is a usable model directory
                if model_src_dir and os.path.isfile(os.path.join(model_src_dir, name)):
                    shutil.copy(os.path.join(model_src_dir, name), os.path.join(tmp, "model", name))
    for path, obj in ((os.path.join(tmp, f"optim_rank{rank}.safetensors"),
                       {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}),
                      (os.path.join(tmp, f"state_rank{rank}.safetensors"), {**trainer_state, "rng": rng_state()})):
        with _writing(step, path, tmp):
            save_state_file(obj, path)
    _barrier()
    if rank == 0:
        files, hashes = {}, {}
        for d, _, names in os.walk(tmp):
            for name in names:
                p = os.path.join(d, name)
                hashes[os.path.relpath(p, tmp)] = _sha256(p, fsync=True)
                files[os.path.relpath(p, tmp)] = os.path.getsize(p)
        seqs = [seq for seq, _, _ in _complete_checkpoints(ckpt_root)[0]]
        manifest = {"format": FORMAT, "step": step, "sequence": max(seqs, default=0) + 1,
                    "world_size": _world(), "files": files, "sha256": hashes}
        if layout is not None:
            manifest["layout"] = dict(layout)
        with _writing(step, os.path.join(tmp, MANIFEST), tmp), open(os.path.join(tmp, MANIFEST + ".part"), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, MANIFEST + ".part"), os.path.join(tmp, MANIFEST))
        _fsync_dir(tmp)
        _settle(ckpt_root, step)  # the tmp copy is now the newest complete one of this step
        _write_latest(ckpt_root, step)
    _barrier()
    return final


def _restore_dtensors(optimizer, optim_state: dict) -> None:
    """FSDP2: each rank saved its shard of the moments; wrap them like their parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for k, st in optim_state["state"].items():
        p = params[k]
        if not hasattr(p, "to_local"):
            continue
        local = p.to_local()
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local.shape:
                st[name] = type(p).from_local(v.to(local.device), p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride())


def _check_state_step(ckpt_dir: str, path: str, state: dict) -> None:
    """The state's step is its directory's ``global_step_N`` (or, under another name, its manifest's):
    a mismatch would resume the weights of one step with the schedule and data cursor of another."""
    name = os.path.basename(os.path.normpath(ckpt_dir))
    m = _STEP_DIR.match(name)
    if m:
        want, source = int(m.group(1)), f"its directory {name}"
    elif os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        want, source = int(_read_manifest(ckpt_dir)["step"]), os.path.join(ckpt_dir, MANIFEST)
    else:
        return
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step != want:
        raise ValueError(f"{path} holds step {step!r}, but {source} says step {want}: the checkpoint's files "
                         "are from different saves; resume from an untouched checkpoint directory")


def verify_checkpoint(ckpt_dir: str, share: tuple = (0, 1)) -> None:
    """Every file of ``ckpt_dir`` still has the sha256 its manifest recorded: a ValueError naming the
    first that does not. ``share=(k, m)``: only the files ``k, k + m, ...`` of the sorted list (ranks
    split the reading). A manifest without hashes (an older version's) is let through with a warning."""
    man = _read_manifest(ckpt_dir)
    hashes = man.get("sha256")
    if not isinstance(hashes, dict):
        if share[0] == 0:
            log.warning("checkpoint %s has no content hashes (saved by an older version): its files are not "
                        "verified", ckpt_dir)
        return
    for name in sorted(man["files"])[share[0]::share[1]]:
        path = os.path.join(ckpt_dir, name)
        got, want = _sha256(path), hashes.get(name)
        if got != want:
            raise ValueError(f"checkpoint file {path!r} does not match its sha256 in {MANIFEST} (now {got[:16]}..., "
                             f"saved {str(want)[:16]}...): it changed after the save (disk or copy corruption, an "
                             "edit); resume from another checkpoint (trainer.resume_mode=resume_path, "
                             "trainer.resume_from_path) or restore this file")


def load_checkpoint(ckpt_dir: str, *, optimizer, scheduler) -> dict:
    """Restore optimiser, schedule and RNG of this rank from ``ckpt_dir``; return its trainer state.

    The model weights are read by the trainer from ``ckpt_dir/model`` when it builds the model.
    """
    rank, world = _rank(), _world()
    path = os.path.join(ckpt_dir, f"state_rank{rank}.safetensors")
    saved = _read_manifest(ckpt_dir).get("world_size") if os.path.isfile(os.path.join(ckpt_dir, MANIFEST)) else None
    if saved not in (None, world):
        check_resume_layout(ckpt_dir, world, {})  # raises, naming both world sizes
    if not os.path.isfile(path):
        have = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("state_rank"))
        raise ValueError(f"trainer.resume_mode: checkpoint {ckpt_dir!r} has no {os.path.basename(path)} for rank "
                         f"{rank} of this run's {world} processes (it holds {', '.join(have) or 'no state file'}): "
                         "resume with the number of processes that saved it")
    optim = load_state_file(os.path.join(ckpt_dir, f"optim_rank{rank}.safetensors"))
    state = load_state_file(path)
    _check_state_step(ckpt_dir, path, state)
    _restore_dtensors(optimizer, optim["optimizer"])
    optimizer.load_state_dict(optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])
    set_rng_state(state.pop("rng"))
    return state
