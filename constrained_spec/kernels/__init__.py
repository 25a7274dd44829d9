"""Bitmask and verification kernels: a plain-torch reference each, Triton kernels, dispatchers.

Bitmask layout (xgrammar / outlines-core): int32 [rows, ceil(V / 32)], bit j of word w allows
token 32 * w + j, -1 allows a whole word. The dispatchers (`apply_bitmask`,
`bitmask_to_draft_vocab`, `apply_target_bitmask_to_draft_logits`, `rejection_sample`) take
`backend="auto"`: Triton on CUDA, a vectorised torch path on CPU. Triton is imported only when
a Triton kernel first runs; set `TRITON_INTERPRET=1` before that to run the kernels on the CPU.
"""

from .apply_bitmask import apply_bitmask, apply_bitmask_reference, apply_bitmask_triton
from .draft_vocab import (
    apply_target_bitmask_to_draft_logits,
    apply_target_bitmask_to_draft_logits_reference,
    apply_target_bitmask_to_draft_logits_triton,
    bitmask_to_draft_vocab,
    bitmask_to_draft_vocab_reference,
    bitmask_to_draft_vocab_triton,
    d2t_from_offsets,
)
from .rejection import (
    RejectionOutput,
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_triton,
)

__all__ = [
    "RejectionOutput",
    "apply_bitmask",
    "apply_bitmask_reference",
    "apply_bitmask_triton",
    "apply_target_bitmask_to_draft_logits",
    "apply_target_bitmask_to_draft_logits_reference",
    "apply_target_bitmask_to_draft_logits_triton",
    "bitmask_to_draft_vocab",
    "bitmask_to_draft_vocab_reference",
    "bitmask_to_draft_vocab_triton",
    "d2t_from_offsets",
    "rejection_sample",
    "rejection_sample_reference",
    "rejection_sample_triton",
]
