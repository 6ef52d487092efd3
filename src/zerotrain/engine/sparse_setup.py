"""The ``sparse_attention`` config section at ``initialize``: applied to the model, never
only exposed.

DeepSpeed parsed the section and left it to the user's model code to read it; a config that
named it but a model that never read it trained dense without a word. Here the section is
applied (see :func:`zerotrain.sparse_attention.swap.apply_sparse_attention`): a model that
already holds ``SparseSelfAttention`` keeps it, the demo GPT and ``transformers`` models get
it swapped in, anything else is an error naming the section.
"""

from __future__ import annotations

from torch import nn

from zerotrain.config.schema import SparseAttentionConfig
from zerotrain.engine.efficiency import refuse_split
from zerotrain.parallel.groups import ProcessGroups
from zerotrain.sparse_attention.swap import apply_sparse_attention
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def setup_sparse_attention(
    model: nn.Module, section: SparseAttentionConfig, groups: ProcessGroups
) -> None:
    """Apply ``section`` to ``model`` (before it moves to its device and is sharded).

    Raises:
        ValueError: the model cannot take it, or it is combined with tensor, sequence or
            pipeline parallelism (each splits the heads or the layers the layout is built for;
            not implemented yet).
    """
    refuse_split("sparse_attention", model, groups)
    done = apply_sparse_attention(model, section.model_dump(exclude_unset=True))
    log.info("sparse_attention (mode %s, block %d): %s", section.mode, section.block, done)
