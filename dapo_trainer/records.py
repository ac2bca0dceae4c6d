"""The records a DAPO step hands from stage to stage (no string-keyed dicts of step tensors).

    GenerationStage --RolloutShare (all-gathered)--> GenerationBatch (a TrainBatch of every
    response, its keep mask) --TrainBatch.tensors()--> dk.DynamicBatchAccumulator --take()-->
    TrainBatch --> Actor.plan: [MiniBatchPlan] --> Actor.pack: MicroBatch (+ old / ref log-probs,
    rollout-correction weights and mask by dataclasses.replace) --> the loss.

The per-response fields keep :class:`Responses`' names end to end; the accumulator's
``{name: tensor}`` dicts (its library API) hold the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Tuple, Union

import torch

from .model import PromptSharing


def _column(dtype: torch.dtype, width: Optional[str] = None):
    """A per-response field: its dtype, and ``"prompt"`` / ``"response"`` for a padded row."""
    return field(metadata={"dtype": dtype, "width": width})


@dataclass
class Responses:
    """Sampled responses, one row each, ``N`` rows: what a train batch keeps of a rollout."""

    prompt_ids: torch.Tensor = _column(torch.int64, "prompt")  # [N, P], pad id past prompt_len
    response_ids: torch.Tensor = _column(torch.int64, "response")  # [N, R], pad id past response_len
    # [N, R] the sampler's log-prob of each sampled token under the distribution it sampled from
    # (temperature-scaled, no top-p renormalisation; verl's rollout_log_probs), 0 past response_len.
    log_probs: torch.Tensor = _column(torch.float32, "response")
    # Tokens the model sampled (multi-turn: the environment's tokens are context, never trained on).
    sampled: torch.Tensor = _column(torch.bool, "response")  # [N, R]
    prompt_len: torch.Tensor = _column(torch.int64)
    response_len: torch.Tensor = _column(torch.int64)
    stopped: torch.Tensor = _column(torch.bool)  # ended on a stop token (else cut at max_response_length)
    score: torch.Tensor = _column(torch.float64)
    acc: torch.Tensor = _column(torch.float64)
    reward: torch.Tensor = _column(torch.float64)  # score plus the overlong penalty: advantages come from it
    turns: torch.Tensor = _column(torch.float64)  # assistant turns (single-turn: 1)
    # Router replay R3: [N, (P + R) x routes], token-major, each token's experts of every sparse layer (routes =
    # layers x num_experts_per_tok; prompt tokens in columns 0..P-1, response tokens from P; -1: not recorded).
    # routes = 0 (no column) unless actor.router_replay.mode=R3.
    routed_experts: torch.Tensor = _column(torch.int64, "routing")


@dataclass
class RolloutShare(Responses):
    """A replica's sampled responses, ``N`` rows.

    ``pack`` lays the fields end to end in one float64 table (exact: ids below 2**53, float32
    log-probs) so that one all-gather carries them; ``unpack`` reads it back by field.
    """

    filter_metric: torch.Tensor = _column(torch.float64)  # what dynamic sampling keeps groups by (not binarised)
    failed: torch.Tensor = _column(torch.bool)  # a conversation the environment failed (on_error=drop)

    @staticmethod
    def _widths(prompt_width: int, response_width: int, routes: int = 0) -> List[int]:
        w = {"prompt": prompt_width, "response": response_width, "routing": (prompt_width + response_width) * routes,
             None: 1}
        return [w[f.metadata["width"]] for f in fields(RolloutShare)]

    def pack(self) -> torch.Tensor:
        n = self.prompt_len.shape[0]
        return torch.cat([getattr(self, f.name).double().reshape(n, -1) for f in fields(self)], 1)

    @classmethod
    def unpack(cls, table: torch.Tensor, prompt_width: int, response_width: int, routes: int = 0) -> "RolloutShare":
        cols = table.split(cls._widths(prompt_width, response_width, routes), 1)
        return cls(**{f.name: (c if f.metadata["width"] else c[:, 0]).to(f.metadata["dtype"], copy=True)
                      for f, c in zip(fields(cls), cols)})

    @classmethod
    def empty(cls, prompt_width: int, response_width: int, routes: int = 0) -> "RolloutShare":
        width = sum(cls._widths(prompt_width, response_width, routes))
        return cls.unpack(torch.zeros(0, width, dtype=torch.float64), prompt_width, response_width, routes)


@dataclass
class TrainBatch(Responses):
    """Responses with their GRPO advantages, grouped by prompt (rows of a group contiguous)."""

    advantages: torch.Tensor = _column(torch.float32)
    group_index: torch.Tensor = _column(torch.int64)  # the row's prompt group

    @classmethod
    def of(cls, responses: Responses, advantages: torch.Tensor, group_index: torch.Tensor) -> "TrainBatch":
        return cls(**{f.name: getattr(responses, f.name) for f in fields(Responses)}, advantages=advantages,
                   group_index=group_index)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The accumulator's ``batch_tensors``: every field but ``group_index`` (its own argument)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_index"}

    @classmethod
    def from_tensors(cls, tensors: Dict[str, torch.Tensor]) -> "TrainBatch":
        """The batch of the accumulator's ``take()`` (its ``group_index`` numbers the taken groups)."""
        return cls(**tensors)


@dataclass
class GenerationBatch:
    """One generation batch after rewards and group filtering (every response, kept or not)."""

    batch: TrainBatch  # group_index: the prompt's index in this generation batch
    keep: torch.Tensor  # [N] bool, whole groups
    metric: torch.Tensor  # [N] the filter metric, binarised by the step's threshold
    raw_metric: torch.Tensor  # [N] the filter metric as the rewards gave it
    rows: List[int]  # the data rows of its prompts
    turn_stats: Dict[str, float]  # this replica's per-turn statistics (multi-turn)
    timing: Dict[str, float]
    tokens: int  # prompt + response tokens of every response
    local_tokens: int  # response tokens this replica sampled
    components: Dict[int, dict]  # this replica's reward components, by row of the batch
    failed_groups: torch.Tensor  # groups with a failed conversation (0-dim)


@dataclass(frozen=True)
class MiniBatchPlan:
    """One mini-batch of the update as this rank runs it."""

    micro: List[List[int]]  # this rank's micro-batches, rows of the train batch
    # Trained-on response tokens of the whole mini-batch (every rank's); after rollout rejection
    # sampling, the count left as a 0-dim device tensor (never read on the host).
    num_tokens: Union[int, torch.Tensor]
    num_seqs: int  # sequences of the whole mini-batch
    max_token_len: Optional[int]  # the micro-batch token cap (actor.use_dynamic_bsz), else None
    tokens: int  # this rank's tokens in its micro-batches
    shape: Optional[int] = None  # pipeline parallel: the static token count of the pipe
    all_tokens: int = 0  # tokens (prompt + response) of the whole mini-batch (every rank's)


@dataclass(frozen=True)
class MicroBatch:
    """Sequences packed end to end (``[T]`` tokens), on the device; labels shifted by one token.

    Under sequence parallelism ``labels``, ``mask`` and ``advantages`` are this rank's token
    shard; ``mask_index`` lists the masked positions (a host-built tensor: no device read) and
    ``response_index`` the same positions' cells ``row * R + k`` of the train batch's ``[N, R]``
    response grid (how per-token values go between the two layouts without a host read).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    mask_index: torch.Tensor
    advantages: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [S + 1]
    max_seqlen: int
    old_log_prob: Optional[torch.Tensor] = None  # [T], recomputed off-policy (bypass_mode: the rollout's)
    ref_log_prob: Optional[torch.Tensor] = None  # [T], the reference model's (KL loss)
    response_index: Optional[torch.Tensor] = None  # [len(mask_index)] int64, see above
    rollout_is_weights: Optional[torch.Tensor] = None  # [T], algorithm.rollout_correction's IS weights
    # Router replay: per sparse layer, the [T, k] experts to route each token to -- R2: the old-log-prob
    # forward's; R3: the rollout's (TrainBatch.routed_experts; -1 rows: the router's own choice).
    routed_experts: Optional[Tuple[torch.Tensor, ...]] = None
    # actor.share_prompts: the rows repeating a prompt compute it once (None: nothing shared).
    sharing: Optional[PromptSharing] = None

    @classmethod
    def empty(cls, device: torch.device) -> "MicroBatch":
        """No sequence: all padding in a pipeline, no loss."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(none, none, none.bool(), none, none.float(), torch.zeros(1, dtype=torch.int32, device=device), 0,
                   response_index=none)
