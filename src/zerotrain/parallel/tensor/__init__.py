"""Tensor parallelism: Megatron's column-, row- and vocabulary-parallel layers and the
vocabulary-parallel cross-entropy; their collectives are the autograd functions of
``zerotrain.comm.regions``."""

from zerotrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from zerotrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerotrain.parallel.tensor.plan import model_tp_plan, parallelize
from zerotrain.parallel.tensor.rng import TensorParallelRNG
from zerotrain.parallel.tensor.sequence_parallel import sum_gradients_over_group

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRNG",
    "VocabParallelEmbedding",
    "model_tp_plan",
    "parallelize",
    "sum_gradients_over_group",
    "vocab_parallel_cross_entropy",
]
