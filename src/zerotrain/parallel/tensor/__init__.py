"""Tensor parallelism: Megatron's column-, row- and vocabulary-parallel layers and the
vocabulary-parallel cross-entropy; their collectives are the autograd functions of
``zerotrain.comm.regions``."""

from zerotrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from zerotrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerotrain.parallel.tensor.plan import model_tp_plan, parallelize, tensor_splits
from zerotrain.parallel.tensor.rng import TensorParallelRNG, attach_rng, tensor_parallel_rng
from zerotrain.parallel.tensor.sequence_parallel import sum_gradients_over_group
from zerotrain.parallel.tensor.splits import TensorSplit

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRNG",
    "TensorSplit",
    "VocabParallelEmbedding",
    "attach_rng",
    "model_tp_plan",
    "parallelize",
    "sum_gradients_over_group",
    "tensor_parallel_rng",
    "tensor_splits",
    "vocab_parallel_cross_entropy",
]
