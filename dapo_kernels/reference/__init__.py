"""Plain torch references, one per op, used only by tests and benchmarks.

The simplest correct code (Python loops allowed), float64 where numerics matter.
Import a reference from here, never from the op files.
"""
from .attention import varlen_attention_ref
from .group_filter import group_filter_ref, overlong_penalty_ref
from .packing import pad_input_ref, packed_position_ids_ref, unpad_input_ref

__all__ = ["unpad_input_ref", "pad_input_ref", "packed_position_ids_ref", "varlen_attention_ref"]
__all__ += ["group_filter_ref", "overlong_penalty_ref"]
