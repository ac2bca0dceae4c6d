"""``dapo-tune``: a trainer config for a task, a machine and a model, with a reason for every value.

``dapo-tune --task-type math|dialog --hardware 1x24GB|1xH200|8xH100|8xA100-40GB|8xAscend910B|cpu
--model PATH [--dataset PATH] [--profile profile.json] [--output FILE]``

PATH is a HF model directory of which only ``config.json`` is read (a 7B or 32B model is planned
without its weights). A Qwen3-MoE ``config.json`` counts all experts' weights and Adam states and the active
experts' activations. The memory side rests on :mod:`dapo_trainer.memory_model`; the batch side on
the expected keep rate of dynamic sampling (the profile's measured one when given, else a prior per
task) and, with ``--dataset``, the prompts' length distribution (tokens when the model directory
has a tokenizer, else characters / 3.5). The YAML loads with ``--config`` in the trainer; model and
data paths are left to the command line.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import yaml

from ..readers import read_json
from . import _cli
from ..memory_model import DTYPE_BYTES, Parallel, kv_bytes_per_token, rollout_memory, train_memory

GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    devices: int
    memory: float  # bytes per device
    device: str  # trainer.device
    dtype: str
    rollout: str  # rollout engine


HARDWARE = {
    "1x24GB": Hardware(1, 24 * GIB, "cuda", "bfloat16", "vllm"),
    "1xH200": Hardware(1, 141 * GIB, "cuda", "bfloat16", "vllm"),
    "8xH100": Hardware(8, 80 * GIB, "cuda", "bfloat16", "vllm"),
    "8xA100-40GB": Hardware(8, 40 * GIB, "cuda", "bfloat16", "vllm"),
    "8xAscend910B": Hardware(8, 64 * GIB, "npu", "bfloat16", "embedded"),
    "cpu": Hardware(1, 16 * GIB, "cpu", "float32", "embedded"),
}
TASKS = {  # prior keep rate, prompt / response lengths, responses per prompt
    "math": {"keep": 0.5, "prompt": 1024, "response": 4096, "n": 16},
    "dialog": {"keep": 0.7, "prompt": 2048, "response": 1024, "n": 8},
}
HEADROOM = 0.9  # of a device's memory: allocator fragmentation, CUDA context, communication buffers
STATE_SHARE = 0.8  # of the usable memory at most for weights, gradients, Adam states (and the sampler's replica)
FILL_PROBABILITY = 0.999  # target probability that max_num_gen_batches fills a step


def _round_up(x: float, to: int) -> int:
    return int(math.ceil(x / to) * to)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _quantile(values: List[int], q: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def dataset_prompt_lengths(path: str, model_dir: str) -> Tuple[List[int], str]:
    from .. import data as data_mod

    rows = data_mod.load_rows([path])
    texts = [r["prompt"] if isinstance(r["prompt"], str) else " ".join(m["content"] for m in r["prompt"])
             for r in rows]
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        tok = data_mod.load_tokenizer(model_dir)
        return [len(tok.encode(t)) for t in texts], "tokens"
    return [math.ceil(len(t) / 3.5) for t in texts], "characters / 3.5 (no tokenizer.json)"


def _profile_number(prof: dict, key: str, path: str, lo: float, hi: float) -> None:
    v = prof.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # (NaN fails the range)
        raise ValueError(f"{path}: {key} must be a number in [{lo:g}, {hi:g}], got {type(v).__name__} {v!r}")


def read_profile(path: str) -> dict:
    """The fields of a ``dapo-profile`` profile.json that the tuner reads, checked (ValueError naming
    the file and key): ``keep_rate`` and ``truncated_share`` in [0, 1], ``steps`` and
    ``config.max_response_length`` ints >= 1 where they are used."""
    prof = read_json(path)
    if not isinstance(prof, dict):
        raise ValueError(f"{path}: a profile must be a JSON object, got {type(prof).__name__}")
    _profile_number(prof, "keep_rate", path, 0.0, 1.0)
    _profile_number(prof, "truncated_share", path, 0.0, 1.0)
    if prof.get("keep_rate") is not None:
        _profile_number(prof, "steps", path, 1, math.inf)
    if (prof.get("truncated_share") or 0) > 0.05:
        length = (prof.get("config") or {}).get("max_response_length") if isinstance(prof.get("config"), dict) \
            else None
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"{path}: config.max_response_length must be an int >= 1, got {length!r}")
    return prof


def fill_probability(gen_batch_size: int, keep: float, need: int, batches: int) -> float:
    """P(Binomial(batches x gen_batch_size, keep) >= need): the chance that ``batches`` generation
    batches keep enough groups."""
    n = batches * gen_batch_size
    if need <= 0:
        return 1.0
    if keep <= 0:
        return 0.0
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(keep)
            + ((n - k) * math.log1p(-keep) if keep < 1 else (0.0 if k == n else -math.inf)) for k in range(need)]
    return max(0.0, 1.0 - sum(math.exp(x) for x in logs))


def _sp_fits(cfg, sp: int, world: int) -> bool:
    """Ulysses SP of ``sp`` ranks is possible: it divides the devices and the heads, and the KV heads
    divide it or it them (dapo_trainer.parallel.sequence)."""
    return world % sp == 0 and cfg.num_heads % sp == 0 and (cfg.num_kv_heads % sp == 0 or sp % cfg.num_kv_heads == 0)


def tune(task_type: str, hardware: str, model_dir: str, dataset: Optional[str] = None,
         profile: Optional[str] = None) -> List[Tuple[str, object, str]]:
    """``[(dotted key, value, reason)]`` of the tuned config."""
    from ..hf_io import read_hf_config

    if task_type not in TASKS:
        raise ValueError(f"task_type must be one of {sorted(TASKS)}, got {task_type!r}")
    if hardware not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {hardware!r}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model {model_dir!r} has no config.json")
    hw, task = HARDWARE[hardware], TASKS[task_type]
    cfg = read_hf_config(model_dir)
    b = DTYPE_BYTES[hw.dtype]
    P = cfg.num_params()
    out: List[Tuple[str, object, str]] = []

    def put(key, value, reason):
        out.append((key, value, reason))

    put("trainer.device", hw.device, f"{hardware}: {hw.devices} x {hw.memory / GIB:.0f} GiB {hw.device} device(s)"
        + (f"; {cfg.model_type}: {cfg.num_experts} experts, {cfg.num_experts_per_tok} active per token"
           if cfg.num_experts else ""))
    put("actor_rollout_ref.model.dtype", hw.dtype,
        "bfloat16 halves parameters, gradients, Adam states and activations on accelerators" if b == 2 else
        "float32 on the CPU (no fast bfloat16 matmuls there)")

    # ---- lengths
    prompt_len, response_len = task["prompt"], task["response"]
    why_prompt = f"{task_type} prior"
    if dataset:
        lens, unit = dataset_prompt_lengths(dataset, model_dir)
        prompt_len = _round_up(_quantile(lens, 0.99) * 1.05, 64)
        why_prompt = (f"{len(lens)} dataset prompts in {unit}: p50 {_quantile(lens, 0.5)}, p99 {_quantile(lens, 0.99)},"
                      f" max {max(lens)}; p99 + 5% rounded to 64 (longer prompts: data.truncation)")
    prof = None
    keep = task["keep"]
    why_keep = f"assumed keep rate {keep:.0%} ({task_type} prior; pass --profile to measure it)"
    if profile:
        prof = read_profile(profile)
        if prof.get("keep_rate") is not None:
            keep = max(0.05, float(prof["keep_rate"]))
            why_keep = f"measured keep rate {prof['keep_rate']:.0%} over {prof['steps']} profiled steps"
        if prof.get("truncated_share", 0) > 0.05:
            response_len = 2 * prof["config"]["max_response_length"]
    if hardware == "cpu":
        prompt_len, response_len = min(prompt_len, 256), min(response_len, 256)
    # The config refuses prompt + response beyond the model's context: the response gives way first.
    context = cfg.max_position_embeddings
    why_context = ""
    if prompt_len + response_len > context:
        prompt_len = min(prompt_len, context // 2)
        response_len = context - prompt_len
        why_context = f"; cut to the model's max_position_embeddings {context}"
    put("data.max_prompt_length", prompt_len, why_prompt + why_context)
    put("data.max_response_length", response_len,
        (f"the profile cut {prof['truncated_share']:.0%} of responses at "
         f"{prof['config']['max_response_length']}: doubled"
         if prof and prof.get("truncated_share", 0) > 0.05 else f"{task_type} prior")
        + ("; capped at 256 for CPU debugging" if hardware == "cpu" else "") + why_context)
    seq = prompt_len + response_len

    # ---- memory layout
    budget = HEADROOM * hw.memory
    world = hw.devices
    # Dense replicas (DDP) while the states take at most half the usable memory; else FSDP over every
    # device, up to STATE_SHARE (the rest is for activations: the token cap search below checks it).
    # One device has no one to shard with: DDP up to STATE_SHARE. Then TP x FSDP (TP sizes dividing the
    # heads, the KV heads, the MLP and the vocabulary), then pipeline stages (the smallest count dividing
    # the layers and the devices, with each TP size), FSDP over the devices left (TP alone over every
    # device is not tried: TP x FSDP, as verl's Megatron layouts). A layout is taken when
    # its states fit and one sequence trains on it with checkpointing and offload (SP only without PP).
    tps = [t for t in (2, 4, 8) if world % t == 0 and t < world and all(
        getattr(cfg, k) % t == 0 for k in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"))]
    layouts = [(1, 1, 1, "ddp", 0.5), (world, 1, 1, "fsdp2", STATE_SHARE)] if world > 1 else \
        [(1, 1, 1, "ddp", STATE_SHARE)]
    layouts += [(world // t, t, 1, "fsdp2" if world > t else "ddp", STATE_SHARE) for t in tps]
    layouts += [(world // (pp * t), t, pp, "fsdp2" if world > pp * t else "ddp", STATE_SHARE)
                for pp in range(2, world + 1) if world % pp == 0 and cfg.num_layers % pp == 0
                for t in [1] + tps if world % (pp * t) == 0]

    def peak(tokens, ckpt, offload, sp, fsdp, tp, pp):
        return train_memory(cfg, tokens * sp, dtype=hw.dtype, checkpointing=ckpt, offload=offload,
                            par=Parallel(tp=tp, fsdp=fsdp, sp=sp, pp=pp), micro_batches=max(2, pp),
                            foreach=hw.device != "cpu")

    chosen, tried, no_seq = None, [], None
    for fsdp, tp, pp, strategy, share in layouts:
        # The states of the pipeline rank holding the most (the embedding's or lm_head's stage).
        static = train_memory(cfg, 1, dtype=hw.dtype, par=Parallel(tp=tp, fsdp=fsdp, pp=pp), micro_batches=pp)
        states = static["params"] + static["grads"] + static["optimizer"]
        # Sharded training keeps an unsharded replica for the sampler (dapo_trainer.trainer), as every pipeline rank.
        replica = P * b if strategy == "fsdp2" or pp > 1 else 0
        if tp == 1:
            tried.append((pp, states + replica))
        if states + replica > share * budget:
            continue
        # The least one sequence needs here (checkpointing, offload, the most SP ranks the layout allows).
        sps = [1] + [s for s in (2, 4, 8) if tp == pp == 1 and _sp_fits(cfg, s, world)]
        seq_need = min(peak(seq, True, True, sp, fsdp, tp, pp)["peak"] for sp in sps) + replica
        if seq_need <= budget:
            chosen = (fsdp, tp, pp, strategy, states, replica)
            break
        if no_seq is None or pp == 1:
            no_seq = (fsdp, tp, seq_need)  # the last pipeline-free layout that fails for the sequence
    if chosen is None and no_seq is not None:
        fsdp, tp, need = no_seq
        raise ValueError(f"one sequence of {seq} tokens does not fit for training on {hardware} even with "
                         f"checkpointing, offload and sequence parallel: {need / GIB:.1f} GiB per device at "
                         f"TP={tp} x FSDP={fsdp} and on every pipeline layout tried, over the {budget / GIB:.0f} "
                         f"GiB usable; lower the lengths")
    if chosen is None:
        fsdp, tp, pp, strategy, share = layouts[min(1, len(layouts) - 1)]
        need = tried[min(1, len(tried) - 1)][1]
        at_pp = "".join(f"; at pipeline_model_parallel_size={k} {n / GIB:.1f} GiB on its largest stage"
                        for k, n in tried if k > 1)
        raise ValueError(f"{_count(P)} parameters need {need / GIB:.1f} GiB per device for "
                         f"weights, gradients and Adam states ({strategy}, {fsdp} shard(s)"
                         f"{', with the sampler replica' if strategy == 'fsdp2' else ''}){at_pp}, over {share:.0%} of "
                         f"{hardware}'s {budget / GIB:.0f} GiB usable; pick more or larger devices or a smaller model")
    fsdp, tp, pp, strategy, states, replica = chosen
    put("actor_rollout_ref.actor.strategy", strategy,
        f"{_count(P)} parameters: weights + gradients + AdamW states = {states / GIB:.1f} GiB per device "
        + ("(DDP: within its share of the usable memory)" if strategy == "ddp" else
           f"sharded over {fsdp} devices (+ {replica / GIB:.1f} GiB unsharded sampler replica)"))
    put("actor_rollout_ref.actor.tensor_model_parallel_size", tp,
        "FSDP sharding suffices; TP only helps when a layer's matmuls are too large for one device" if tp == 1 else
        f"one sequence does not fit with FSDP alone: TP={tp}, the smallest of {tps} (sizes below {world} dividing "
        f"the heads, the {cfg.num_kv_heads} KV heads, the MLP and the vocabulary) with which it fits")
    if pp > 1:
        stage = peak(seq, True, True, 1, fsdp, tp, pp)
        if no_seq is not None:
            why = (f"the layers do not fit after TP={no_seq[1]} x FSDP={no_seq[0]} (TP sizes dividing the "
                   f"{cfg.num_heads} heads and {cfg.num_kv_heads} KV heads: {tps or 'none'} below {world}; SP: "
                   f"{[s for s in (2, 4, 8) if _sp_fits(cfg, s, world)] or 'none'}): one {seq}-token sequence "
                   f"needs {no_seq[2] / GIB:.1f} GiB per device with checkpointing and offload (FSDP shards "
                   f"neither the activations nor the gathered layers and root), over {budget / GIB:.0f} GiB")
        else:
            why = (f"the layers do not fit one device's share at one stage ({tried[1][1] / GIB:.1f} GiB of weights, "
                   f"gradients, AdamW states and replica > {STATE_SHARE:.0%} of {budget / GIB:.0f} GiB)")
        put("actor_rollout_ref.actor.pipeline_model_parallel_size", pp,
            f"{why}; PP={pp} (x TP={tp} x FSDP={fsdp}, checkpointing and offload) gives "
            f"{(stage['peak'] + replica) / GIB:.1f} GiB per GPU "
            f"on its largest stage (stage {int(stage['stage'])}, {cfg.num_layers // pp} layers each), the "
            f"smallest stage count dividing the {cfg.num_layers} layers that fits")
    micro = max(2, pp)  # micro-batches per mini-batch: at least one per pipeline stage

    def fits(tokens, ckpt, offload, sp):
        return peak(tokens, ckpt, offload, sp, fsdp, tp, pp)["peak"] + replica <= budget

    def max_tokens(ckpt, offload, sp):
        lo, hi = 0, 1 << 20
        while lo < hi:  # largest multiple of 1024 that fits (binary search on 1024-token units)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * 1024, ckpt, offload, sp) else (lo, mid - 1)
        return lo * 1024

    ckpt = offload = False
    sp = 1
    cap = no_ckpt = max_tokens(False, False, 1)
    why_ckpt = f"without checkpointing {cap} tokens per micro-batch fit, >= 4 sequences of {seq}"
    if cap < 4 * seq:
        ckpt, cap = True, max_tokens(True, False, 1)
        why_ckpt = (f"without it only {no_ckpt} tokens per micro-batch fit (< 4 x {seq}); "
                    f"with it {cap}")
    if cap < seq:
        offload, cap = True, max_tokens(True, True, 1)
    while cap < seq and tp == pp == 1 and _sp_fits(cfg, sp * 2, world):  # SP x PP, SP x TP: not supported
        sp *= 2
        cap = max_tokens(ckpt, offload, sp)
    if cap < seq:
        raise ValueError(f"one sequence of {seq} tokens does not fit for training on {hardware} even with "
                         f"checkpointing, offload and sequence parallel {sp}; lower the lengths")
    put("actor_rollout_ref.model.enable_gradient_checkpointing", ckpt, why_ckpt)
    put("actor_rollout_ref.model.enable_activation_offload", offload,
        "checkpointed layer inputs in host memory: needed for one sequence to fit" if offload else
        "not needed: a sequence fits with the layer inputs on the device")
    put("actor_rollout_ref.actor.ulysses_sequence_parallel_size", sp,
        f"one sequence ({seq} tokens) fits per rank" if sp == 1 else f"a {seq}-token sequence needs {sp} ranks")
    cap = min(cap, 65536)
    m = train_memory(cfg, cap * sp, dtype=hw.dtype, checkpointing=ckpt, offload=offload,
                     par=Parallel(tp=tp, fsdp=fsdp, sp=sp, pp=pp), micro_batches=micro, foreach=hw.device != "cpu")
    put("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", cap,
        f"largest multiple of 1024 (at most 65536) whose predicted peak {(m['peak'] + replica) / GIB:.1f} GiB "
        f"(activations {m['activations'] / GIB:.1f}, fused-loss workspace {m['loss'] / GIB:.2f}) stays under "
        f"{HEADROOM:.0%} of {hw.memory / GIB:.0f} GiB")
    put("actor_rollout_ref.actor.use_dynamic_bsz", True,
        "token-capped micro-batches: variable-length responses pack to the cap instead of a fixed count")

    # ---- batches
    dp = world // (tp * sp * pp)
    n = 4 if hardware == "cpu" else task["n"]
    put("actor_rollout_ref.rollout.n", n, "CPU debugging: few responses" if hardware == "cpu" else
        f"{task_type}: {n} responses per prompt give the group baseline enough spread")
    if hardware == "cpu":
        train_bs, gen_bs, max_gen = 4, 8, 3
        why_gen = "CPU debugging: a small generation batch"
        why_max = "CPU debugging: fail fast when filtering keeps too little (3 batches)"
    else:
        train_bs = _round_up(max(32, 16 * world), dp)
        gen_bs = _round_up(train_bs / keep * 1.1, dp)
        max_gen = 1
        while fill_probability(gen_bs, keep, train_bs, max_gen) < FILL_PROBABILITY:
            max_gen += 1
        why_gen = (f"train_batch_size / keep rate x 1.1 = {train_bs} / {keep:.2f} x 1.1, rounded to a multiple of "
                   f"DP={dp}; {why_keep}")
        why_max = (f"{max_gen} batches fill a step with probability >= {FILL_PROBABILITY} at keep rate {keep:.2f} "
                   f"(binomial); doubled to {2 * max_gen} for the keep rate falling as the policy improves")
        max_gen *= 2
    put("data.train_batch_size", train_bs, f"prompt groups per step: {16 if hardware != 'cpu' else 1} per device, at "
        "least 32, a multiple of DP" if hardware != "cpu" else "CPU debugging: 4 prompt groups per step")
    put("data.gen_batch_size", gen_bs, why_gen)
    put("algorithm.filter_groups.enable", True,
        "DAPO dynamic sampling: groups whose reward does not vary teach nothing")
    put("algorithm.filter_groups.max_num_gen_batches", max_gen, why_max)
    mini = max(1, train_bs // 4)
    while train_bs % mini:
        mini -= 1
    while mini * n < dp * pp and mini < train_bs:  # every stage of every DP replica needs a micro-batch
        mini += 1
        while train_bs % mini:
            mini += 1
    put("actor_rollout_ref.actor.ppo_mini_batch_size", mini,
        f"{train_bs // mini} policy updates per step on the same samples ({train_bs} / {mini}), so the clip ratios act"
        + (f"; {mini} x n={n} rows >= DP {dp} x {pp} pipeline stages" if pp > 1 else ""))

    # ---- rollout memory
    kv_tok = kv_bytes_per_token(cfg, b, 1)
    seqs = math.ceil(gen_bs * n / dp)
    engine = rollout_memory(cfg, seqs, seq, dtype_bytes=b)
    weights, kv_need = engine["weights"], engine["kv_cache"]
    resident = states + replica  # training state stays on the device while the engine generates
    free = HEADROOM * hw.memory - resident
    util = min(0.9, max(0.3, (weights + kv_need) / hw.memory))
    util = max(0.05, math.floor(min(util, free / hw.memory) * 20) / 20)  # down to a multiple of 0.05
    concurrent = max(0, int((util * hw.memory - weights) // (seq * kv_tok)))
    put("actor_rollout_ref.rollout.gpu_memory_utilization", util,
        f"the engine's weights {weights / GIB:.1f} GiB + KV cache for {seqs} sequences x {seq} tokens "
        f"({kv_tok / 1024:.0f} KiB per token) = {(weights + kv_need) / GIB:.1f} GiB; the training state "
        f"({resident / GIB:.1f} GiB) stays resident, so at most {free / GIB:.1f} GiB are free; {concurrent} "
        "sequences decode at once at this setting")
    put("actor_rollout_ref.rollout.name", hw.rollout,
        "vLLM on CUDA" if hw.rollout == "vllm" else "the embedded sampler (no vLLM build for this device here)")
    return out


def to_yaml(values: List[Tuple[str, object, str]], header: str) -> str:
    """Nested YAML with each value's reason as a comment line above it (loadable by load_config)."""
    lines = [f"# {x}" for x in header.splitlines()]
    opened: List[str] = []
    for key, value, reason in sorted(values, key=lambda kv: kv[0].split(".")[:-1]):
        parts = key.split(".")
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            lines.append("  " * depth + parts[depth] + ":")
            opened.append(parts[depth])
        pad = "  " * (len(parts) - 1)
        lines.append(f"{pad}# {reason}")
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"{pad}{parts[-1]}: {text}")
    return "\n".join(lines) + "\n"


def cli(argv: Optional[List[str]] = None) -> str:
    """``dapo-tune`` with ``argv``: prints the YAML (and writes ``--output``); returns its text."""
    ap = argparse.ArgumentParser(prog="dapo-tune", description=__doc__.splitlines()[0])
    ap.add_argument("--task-type", required=True, choices=sorted(TASKS))
    ap.add_argument("--hardware", required=True, choices=list(HARDWARE))
    ap.add_argument("--model", required=True, help="HF model directory (only config.json is read)")
    ap.add_argument("--dataset", default=None, help="training prompts (.jsonl / .parquet): length distribution")
    ap.add_argument("--profile", default=None, help="profile.json of dapo-profile: measured keep rate")
    ap.add_argument("--output", default=None, help="write the YAML here too")
    _cli.add_debug_flag(ap)
    args = ap.parse_args(argv)
    return _cli.run("dapo-tune", args.debug, _run, args)


def _run(args) -> str:
    if args.output and os.path.isdir(args.output):
        raise ValueError(f"--output {args.output!r} is a directory; name the YAML file to write")
    values = tune(args.task_type, args.hardware, args.model, args.dataset, args.profile)
    name = os.path.basename(os.path.normpath(args.model))
    text = to_yaml(values, f"dapo-tune --task-type {args.task_type} --hardware {args.hardware} --model {name}"
                   + (" --dataset" if args.dataset else "") + (" --profile" if args.profile else "")
                   + "\nSet actor_rollout_ref.model.path and data.train_files on the command line.")
    print(text, end="")
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return text


def main(argv: Optional[List[str]] = None) -> int:
    """The console script: exit status 0 (the wrapper passes a returned value to ``sys.exit``)."""
    cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
