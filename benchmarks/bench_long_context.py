"""Peak activation memory per rank of a 32k-token pack on the CPU: Ulysses SP 1 / 2 / 4 x offload off / on.

Run: ``PYTHONPATH=. python benchmarks/bench_long_context.py`` (gloo processes; a few minutes).

Model: Llama-shaped, hidden 64, 16 layers, 4 query / 2 KV heads of 16, ffn 128, vocab 128,
float32, activation checkpointing on; one training step (forward, ``dk.fused_linear_policy_loss``
token mean over the global count, backward) on 32768 packed tokens (sequences of 256..768
tokens laid end to end; shards cut through sequences). Each configuration runs in fresh
processes; a rank's activation memory is its peak RSS during the step minus its RSS before it,
after a warm-up step on 512 tokens (which pages in the kernels' code and sets up the process
group's buffers: fixed costs, not activations). glibc's mmap threshold is pinned so freed
activations leave RSS the same way in every run.

Prediction (written before measuring). Let ``u = t * hidden * 4`` bytes, ``t = 32768 / sp``
this rank's tokens:

* Sequence parallelism: every activation is per token (``[t, ...]``) or, inside attention,
  per head shard (``[32768, heads / sp, ...]``, the same size): activation memory per rank
  falls by the factor ``sp`` (2 and 4), up to fixed costs (the process, the weights' grads).
* Offload: with checkpointing the forward leaves ``L = 16`` layer inputs (``L * u``) on the
  device; the backward then holds one layer's recomputed activations and their gradients,
  ``W * u`` with ``W`` about 30 for this shape (q, k, v, rotary copies, attention out, norms,
  gate / up / SiLU product at ffn = 2 * hidden, and as much again for their gradients).
  Offload keeps one input on the device at a time here (the fake host below is synchronous;
  CUDA's prefetch keeps two), so the peak drops by ``(L - 1) * u``: the factor
  ``(L + W) / (1 + W)`` ~ 46 / 31 ~ 1.5 at every sp (both terms scale with ``t``).

The CPU has no separate host memory, so offload's real policy moves nothing here (its rows
would equal "off"); the benchmark's fake host is a file (page cache, outside the process's
RSS), which removes the bytes from RSS as a device-to-host copy removes them from the GPU.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_trainer import ModelConfig, Transformer
from dapo_trainer.offload import ActivationOffload, OffloadedTensor
from dapo_trainer.parallel import apply_sequence_parallel, shard_sequence
from tests.helpers import cu_seqlens_from, spawn_process_group

TOKENS = 32768
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=16, num_heads=4,
                  num_kv_heads=2, head_dim=16)
W_PREDICTED = 30


class FileOffload(ActivationOffload):
    """Fake host memory for the CPU: offloaded tensors go to a file and are read back from it."""

    def __init__(self, path: str):
        super().__init__()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self.end = 0

    def to_host(self, t):
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        os.pwrite(self.fd, memoryview(raw), self.end)
        saved = OffloadedTensor((self.end, t.shape, t.dtype), t.device)
        self.end += raw.nbytes
        return saved

    def to_device(self, saved):
        offset, shape, dtype = saved.host
        out = torch.empty(shape, dtype=dtype)
        raw = out.view(-1).view(torch.uint8).numpy()
        os.preadv(self.fd, [memoryview(raw)], offset)
        return out.to(saved.device)


def _lengths():
    g = torch.Generator().manual_seed(0)
    lens = []
    while sum(lens) < TOKENS:
        lens.append(int(torch.randint(256, 769, (1,), generator=g)))
    lens[-1] -= sum(lens) - TOKENS
    return lens


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _step(model, lens, sp):
    tokens = sum(lens)
    ids = torch.randint(0, CFG.vocab_size, (tokens,))
    cu = cu_seqlens_from(lens)
    mask = torch.ones(tokens, dtype=torch.bool)
    mask[cu[1:].long() - 1] = False
    labels, adv = torch.roll(ids, -1), torch.randn(tokens)
    if sp > 1:
        labels, mask, adv = (shard_sequence(x, dist.group.WORLD) for x in (labels, mask, adv))
    hidden = model(ids, cu, max(lens))
    loss, _ = dk.fused_linear_policy_loss(hidden, model.lm_head.weight, labels, None, adv, mask,
                                          num_tokens=tokens - len(lens))
    loss.backward()
    return hidden.shape[0]


def _rank(rank: int, sp: int, offload: bool, out_dir: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(CFG).init_weights()
    model.activation_checkpointing = True
    if sp > 1:
        apply_sequence_parallel(model, dist.group.WORLD)
    _step(model, [300, 212], sp)  # warm-up: code pages, gloo buffers, parameter grads
    model.activation_offload = FileOffload(os.path.join(out_dir, f"offload{rank}.bin")) if offload else None
    gc.collect()
    base = _rss()
    t0 = time.perf_counter()
    tokens = _step(model, _lengths(), sp)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"activation_bytes": peak - base, "seconds": seconds, "tokens": tokens,
           "offloaded_bytes": model.activation_offload.stats["bytes"] if offload else 0}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def run(sp: int, offload: bool) -> list:
    with tempfile.TemporaryDirectory() as d:
        spawn_process_group(_rank, sp, sp, offload, d, timeout=datetime.timedelta(seconds=900))
        out = []
        for r in range(sp):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def main():
    # A fixed threshold: freed large blocks go back to the OS at once in every run, so RSS peaks
    # compare (glibc otherwise raises the threshold as blocks are freed and keeps them).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    L = CFG.num_layers
    rows, mib = {}, 2.0 ** 20
    print(f"{TOKENS}-token pack, {L} layers, hidden {CFG.hidden_size}; activation MiB per rank (peak RSS - RSS before)")
    print(f"{'sp':>3} {'offload':>8} {'tokens/rank':>11} {'act MiB':>8} {'vs sp=1':>8} {'on/off':>7} "
          f"{'predicted':>9} {'drop MiB':>8} {'predicted':>9} {'moved MiB':>9} {'step s':>7}")
    for sp in (1, 2, 4):
        for offload in (False, True):
            res = run(sp, offload)
            act = max(r["activation_bytes"] for r in res)
            rows[(sp, offload)] = act
            vs1 = rows[(1, offload)] / act
            onoff = f"{rows[(sp, False)] / act:.2f}" if offload else ""
            pred = f"x{(L + W_PREDICTED) / (1 + W_PREDICTED):.2f}" if offload else f"x{sp}"
            u = TOKENS // sp * CFG.hidden_size * 4 / mib  # one layer input, MiB
            drop = f"{(rows[(sp, False)] - act) / mib:.1f}" if offload else ""
            drop_pred = f"{(L - 1) * u:.1f}" if offload else ""
            print(f"{sp:>3} {str(offload):>8} {res[0]['tokens']:>11} {act / mib:>8.1f} {vs1:>8.2f} {onoff:>7} "
                  f"{pred:>9} {drop:>8} {drop_pred:>9} {max(r['offloaded_bytes'] for r in res) / mib:>9.1f} "
                  f"{max(r['seconds'] for r in res):>7.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
