"""Medusa tree-attention decoding (arXiv:2401.10774) on unmodified Hugging Face causal LMs.

Needs only torch and transformers; never imports training code.
"""

from medusa_train.choices import MEDUSA_63

from .acceptance import ACCEPTANCE_RULES, Accepted, accept_greedy, accept_sample, accept_typical, warp_probs
from .attention import ATTENTION_CHOICES, AttentionBackendError, TreeMask, tree_attention
from .batched import MedusaBatchOutput, RowKVCache, medusa_generate_batch
from .calibrate import (
    choose_tree,
    compute_head_accuracy,
    expected_tau,
    grow_tree,
    head_topk_accuracy,
    measure_forward_latency,
    per_rank_accuracy,
)
from .generate import MedusaOutput, PackedHeads, medusa_generate, tree_attention_mask, verify_forward
from .static import StaticDecoder, medusa_generate_static
from .tree import TreeBuffers, TreeError, chain_tree, load_choices, save_choices

__all__ = [
    "ACCEPTANCE_RULES",
    "ATTENTION_CHOICES",
    "AttentionBackendError",
    "TreeMask",
    "tree_attention",
    "MEDUSA_63",
    "Accepted",
    "MedusaBatchOutput",
    "MedusaOutput",
    "PackedHeads",
    "RowKVCache",
    "StaticDecoder",
    "TreeBuffers",
    "TreeError",
    "accept_greedy",
    "accept_sample",
    "accept_typical",
    "chain_tree",
    "choose_tree",
    "compute_head_accuracy",
    "expected_tau",
    "grow_tree",
    "head_topk_accuracy",
    "load_choices",
    "measure_forward_latency",
    "medusa_generate",
    "medusa_generate_batch",
    "medusa_generate_static",
    "per_rank_accuracy",
    "save_choices",
    "tree_attention_mask",
    "verify_forward",
    "warp_probs",
]
