"""Launchers of the Triton kernels (the ``triton`` backend of ``moe_experts_fwd`` / ``_bwd``)."""
from __future__ import annotations
