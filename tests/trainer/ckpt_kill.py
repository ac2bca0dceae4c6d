"""Harness of test_checkpoint's SIGKILL test: ``python -m tests.trainer.ckpt_kill DIR OUT N``.

A saver (a fork of this process) writes checkpoints with ``save_checkpoint`` and is
SIGKILLed:

- ``sweep``: just before its k-th file operation (open for writing, safetensors / torch
  write, mkdir, rename, unlink, rmdir; fsync is not counted: a SIGKILL loses nothing it
  would have flushed), for every k of a schedule that saves a first checkpoint, a second
  one, re-saves the latest step and re-saves an older one (a rollback).
  The resume that follows is then killed after 1, 2, 3, ... of its own operations (each
  one starting from what the previous left) until one finishes.
- ``random``: at a random time chosen by this process, N times in a row on one directory,
  while the saver resumes (recovery included) or saves; each saver resumes from what the
  previous one left and goes on saving (forward, re-saving the same step, or rolling back).

After each kill this process resumes from a copy of the directory (``latest_checkpoint`` +
``load_checkpoint``) and writes one JSON line to OUT with what the journal says may be
resumed (the last save that finished or the last resume, and the save in flight), what was
resumed (read back from its files), and every checkpoint that can be loaded. Only the public
checkpoint API is used, so the harness runs against any version of it.
"""
from __future__ import annotations

import builtins
import json
import logging
import os
import random
import shutil
import signal
import sys
import time

import torch

torch.set_num_threads(1)
logging.disable(logging.WARNING)  # the resume log lines, one per check

import safetensors.torch  # noqa: E402

from dapo_trainer import checkpoint as ckpt  # noqa: E402
from dapo_trainer.model import ModelConfig, Transformer  # noqa: E402

CFG = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                  head_dim=4, max_position_embeddings=8)
SCHEDULE = [1, 2, 2, 1]  # first save, next, re-save of the latest step, re-save of an older one (rollback)
_open = builtins.open
# os.makedirs and shutil's copies go through os.mkdir and open.
_FILE_OPS = [(os, "replace"), (os, "rename"), (os, "mkdir"), (os, "remove"), (os, "unlink"), (os, "rmdir"),
             (safetensors.torch, "save_file"), (torch, "save")]


def arm(kill_at: int) -> list:
    """Count this process's file operations; SIGKILL it just before number ``kill_at``."""
    count = [0]

    def counted(fn, writes=lambda *a, **k: True):
        def op(*a, **k):
            if writes(*a, **k):
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return op

    for mod, name in _FILE_OPS:
        setattr(mod, name, counted(getattr(mod, name)))
    builtins.open = counted(_open, lambda f, mode="r", *a, **k: any(c in mode for c in "wax+"))
    return count


class Journal:
    """Append-only log of this run's saves and resumes (one os.write per line: a kill never
    leaves half a line)."""

    def __init__(self, path):
        self.path = path

    def write(self, kind, step, version):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{kind} {step} {version}\n".encode())
        os.close(fd)

    def expected(self):
        """(allowed resume states, None meaning "from scratch"; newest finished version per
        step; the save in flight)."""
        last, inflight, versions = None, None, {}
        if os.path.isfile(self.path):
            with _open(self.path) as f:
                for line in f:
                    kind, step, version = line.split()
                    sv = (int(step), int(version))
                    if kind == "begin":
                        inflight = sv
                    else:  # "done" / "resumed": a finished state the next resume may return
                        last, inflight = sv, None
                        versions[sv[0]] = sv[1]
        allowed = [last] + ([inflight] if inflight else [])
        return allowed, versions, inflight


def fresh():
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the moments
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def save(root, step, version, journal, parts):
    """Checkpoint whose weights, Adam moments and trainer state all carry ``version``."""
    model, opt, sch = parts
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(version))
        for st in opt.state.values():
            st["exp_avg"].fill_(float(version))
    journal.write("begin", step, version)
    ckpt.save_checkpoint(root, step, model=model, full_state=model.state_dict(), optimizer=opt, scheduler=sch,
                         trainer_state={"step": step, "version": version})
    journal.write("done", step, version)


def read_back(d):
    """(dir step, state step, state version, weight values, moment values) of checkpoint dir ``d``."""
    model, opt, sch = fresh()
    state = ckpt.load_checkpoint(d, optimizer=opt, scheduler=sch)
    weights = set()
    for name in os.listdir(os.path.join(d, "model")):
        if name.endswith(".safetensors"):
            weights |= {float(v) for t in safetensors.torch.load_file(os.path.join(d, "model", name)).values()
                        for v in t.unique()}
    moments = {float(v) for st in opt.state.values() for v in st["exp_avg"].unique()}
    return [int(os.path.basename(d).split("_")[-1]), int(state["step"]), int(state["version"]), sorted(weights),
            sorted(moments)]


def loadable(root):
    """{step: version} of every ``global_step_N`` that loads whole."""
    out = {}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("global_step_"):
            try:
                out[int(name.split("_")[-1])] = read_back(os.path.join(root, name))[2]
            except Exception:  # incomplete: not counted
                pass
    return out


def check(root, journal, record):
    """Resume from a copy of ``root`` (the original keeps what the kill left) and describe it."""
    scratch = root + ".check"
    shutil.rmtree(scratch, ignore_errors=True)
    if os.path.isdir(root):
        shutil.copytree(root, scratch)
    allowed, versions, inflight = journal.expected()
    try:
        d = ckpt.latest_checkpoint(scratch)
        resumed = read_back(d) if d else None
    except Exception as e:  # a resume that fails is recorded, and the test reports it
        resumed = [f"{type(e).__name__}: {e}"]
    latest = os.path.join(scratch, ckpt.LATEST_FILE)
    record.update(allowed=allowed, versions=versions, inflight=inflight, resumed=resumed,
                  loadable=loadable(scratch), latest=_open(latest).read().strip() if os.path.isfile(latest) else None)
    shutil.rmtree(scratch, ignore_errors=True)
    return record


def run_forked(fn, kill_at=0, kill_after_s=None):
    """Run ``fn`` in a fork, armed to die before file operation ``kill_at`` (0: never) or
    killed by us after ``kill_after_s``; returns (killed, operations it counted)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        count = arm(kill_at)
        try:
            fn()
            os.write(w, str(count[0]).encode())
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(w)
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    counted = os.read(r, 64).decode()
    os.close(r)
    return os.WIFSIGNALED(status), int(counted) if counted else None


def sweep(root, out):
    journal = Journal(root + ".journal")

    def schedule():
        parts = fresh()
        for version, step in enumerate(SCHEDULE, 1):
            save(root, step, version, journal, parts)

    shutil.rmtree(root, ignore_errors=True)
    _, total = run_forked(schedule)
    for k in range(1, total + 2):  # k = total + 1: not killed
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        if os.path.exists(journal.path):
            os.remove(journal.path)
        killed, _ = run_forked(schedule, kill_at=k)
        recovery_kills = 0
        while killed and recovery_kills < 50:  # resumes killed after 1, 2, 3, ... of their own operations
            killed, _ = run_forked(lambda: ckpt.latest_checkpoint(root), kill_at=recovery_kills + 2)
            recovery_kills += killed
        record = {"mode": "sweep", "k": k, "total": total, "recovery_kills": recovery_kills}
        out.write(json.dumps(check(root, journal, record)) + "\n")
        out.flush()


def random_kills(root, out, trials):
    journal = Journal(root + ".journal")
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(int(os.environ.get("DAPO_TEST_SEED", "0")))

    def saver(seed):
        def go():
            parts = fresh()
            d = ckpt.latest_checkpoint(root)
            step = 0
            if d:
                _, step, version, _, _ = read_back(d)
                journal.write("resumed", step, version)
            r = random.Random(seed)
            for i in range(1, 100):
                step = min(max(1, step + r.choice([1, 1, 0, -1])), 5)  # forward, re-save, roll back
                save(root, step, seed * 1000 + i, journal, parts)
        return go

    for t in range(1, trials + 1):
        run_forked(saver(t), kill_after_s=rng.uniform(0.0, 0.4))
        out.write(json.dumps(check(root, journal, {"mode": "random", "trial": t})) + "\n")
        out.flush()


if __name__ == "__main__":
    work, out_path, trials = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(work, exist_ok=True)
    # Load everything a save and a resume import lazily once, here, not in every fork.
    warm = os.path.join(work, "warmup")
    save(warm, 1, 0, Journal(warm + ".journal"), fresh())
    read_back(ckpt.latest_checkpoint(warm))
    with _open(out_path, "w") as out:
        sweep(os.path.join(work, "sweep"), out)
        random_kills(os.path.join(work, "random"), out, trials)
