"""The pipeline bubble and the activation memory per stage of torch's 1F1B and interleaved 1F1B
schedules, as dapo_trainer's PipelinedActor runs them (PipelineStage, gloo processes, real P2P).

Each stage's compute is a timed sleep (forward ``t_f``, backward ``2 t_f`` per full stage; a
virtual stage does ``1/v`` of it), so the measured idle time is the schedule's and the
communication's, not the shared CPU's contention. Per rank: idle fraction = 1 - compute / step
wall time, against the textbook (p - 1) / (v m + p - 1); peak activation memory = the most
micro-batch activations held at once (forwards not yet backpropagated, each weighted by its
chunk's share of the stage), in units of one micro-batch through one full stage.

    python benchmarks/bench_pipeline.py [--pp 2 4] [--micro 4 8 16] [--tf-ms 20]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        _Sleep.busy += seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        _Sleep.busy += 2 * ctx.seconds
        time.sleep(2 * ctx.seconds)
        return g * 1.0, None


_Sleep.busy = 0.0


class Chunk(nn.Module):
    """A stage chunk of calibrated cost; counts the micro-batch activations it holds."""

    live = 0.0
    peak = 0.0

    def __init__(self, hidden: int, seconds: float, share: float):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.seconds, self.share = seconds, share

    def forward(self, x):
        y = _Sleep.apply(self.lin(x), self.seconds)
        if torch.is_grad_enabled():
            Chunk.live += self.share
            Chunk.peak = max(Chunk.peak, Chunk.live)
            share = self.share

            def release(g):
                Chunk.live -= share
                return g
            y.register_hook(release)
        return y


def _worker(rank: int, world: int, cases, tf: float, out_dir: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    rows = []
    for v, m in cases:
        torch.manual_seed(0)
        n = world * v
        chunks = [Chunk(16, tf / v, 1.0 / v) for _ in range(v)]
        stages = [PipelineStage(c, rank + k * world, n, torch.device("cpu"),
                                input_args=(torch.zeros(8, 16, requires_grad=True),),
                                output_args=(torch.zeros(8, 16, requires_grad=True),)) for k, c in enumerate(chunks)]
        loss = lambda out, tgt: out.sum()  # noqa: E731
        sched = (Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False) if v == 1 else
                 ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False))
        x = torch.randn(m * 8, 16)
        best = None
        for _ in range(3):  # the first step also sets up the stages' buffers: the best of 3
            Chunk.live = Chunk.peak = 0.0
            _Sleep.busy = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            sched.step(*((x,) if rank == 0 else ()), target=torch.zeros(m * 8, 16), return_outputs=False)
            dist.barrier()  # the step ends when the last stage's work does: the wait for it is bubble too
            wall = time.perf_counter() - t0
            idle = 1 - _Sleep.busy / wall
            if best is None or idle < best[0]:
                best = (idle, Chunk.peak)
        rows.append((v, m, best[0], best[1]))
    torch.save(rows, os.path.join(out_dir, f"pp{world}_rank{rank}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--tf-ms", type=float, default=20.0)
    ap.add_argument("--out", default="/tmp/bench_pipeline")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    os.makedirs(args.out, exist_ok=True)
    print("| p | schedule | m | textbook bubble | idle fraction per stage (rank 0 .. p-1) | "
          "peak activations per stage (micro-batch x full stage) |")
    print("|---|---|---|---|---|---|")
    for pp in args.pp:
        cases = [(v, m) for v in (1, 2) for m in args.micro]
        os.environ["MASTER_PORT"] = str(free_port())
        mp.start_processes(_worker, args=(pp, cases, args.tf_ms / 1e3, args.out), nprocs=pp, start_method="spawn")
        per_rank = [torch.load(os.path.join(args.out, f"pp{pp}_rank{r}.pt")) for r in range(pp)]
        for i, (v, m) in enumerate(cases):
            textbook = (pp - 1) / (v * m + pp - 1)
            idle = " / ".join(f"{rows[i][2]:.2f}" for rows in per_rank)
            peak = " / ".join(f"{rows[i][3]:.1f}" for rows in per_rank)
            name = "1F1B" if v == 1 else f"interleaved v={v}"
            print(f"| {pp} | {name} | {m} | {textbook:.2f} | {idle} | {peak} |")


if __name__ == "__main__":
    main()
