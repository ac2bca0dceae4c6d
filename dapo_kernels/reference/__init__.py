"""Plain torch references, one per op and named after it, used only by tests and benchmarks.

The simplest correct code (Python loops allowed), float64 where numerics matter.
Import a reference from here, never from the op files.
"""
from .balancing import karmarkar_karp_ref, micro_batch_count_ref, spread_of
from .fused_linear_policy_loss import fused_linear_policy_loss_ref
from .group_filter import group_filter_ref
from .kl_penalty import kl_penalty_ref
from .linear_log_probs import linear_log_probs_ref
from .moe import moe_experts_ref, moe_load_balancing_loss_ref, moe_route_ref, moe_tokens_per_expert_ref
from .overlong_penalty import overlong_penalty_ref
from .packing import pad_input_ref, packed_position_ids_ref, unpad_input_ref
from .policy_loss import agg_loss_ref, policy_loss_ref
from .rollout_correction import rollout_correction_ref
from .varlen_attention import varlen_attention_ref

__all__ = ["unpad_input_ref", "pad_input_ref", "packed_position_ids_ref", "varlen_attention_ref"]
__all__ += ["group_filter_ref", "overlong_penalty_ref", "rollout_correction_ref"]
__all__ += ["policy_loss_ref", "agg_loss_ref", "kl_penalty_ref", "linear_log_probs_ref", "fused_linear_policy_loss_ref"]
__all__ += ["karmarkar_karp_ref", "micro_batch_count_ref", "spread_of"]
__all__ += ["moe_route_ref", "moe_experts_ref", "moe_load_balancing_loss_ref", "moe_tokens_per_expert_ref"]
