"""Block-sparse self-attention with DeepSpeed's layouts, names and config keys.

See docs/sparse_attention.md. ``SparseSelfAttention`` runs a pure-torch blocked kernel that
trains on any device, or compiled FlexAttention where that runs; ``swap`` puts it into the demo
GPT and into BERT-, GPT-2- and Llama-style ``transformers`` models.
"""

from zerotrain.sparse_attention.attention import SparseSelfAttention
from zerotrain.sparse_attention.from_config import sparsity_config_from_dict
from zerotrain.sparse_attention.padding import pad_to_block_size, unpad_sequence_output
from zerotrain.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "pad_to_block_size",
    "sparsity_config_from_dict",
    "unpad_sequence_output",
]
