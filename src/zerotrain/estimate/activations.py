"""Activation memory of a GPT-like model: the tensors autograd saves in forward for
backward, plus the largest temporaries of the first backward steps.

Derivation, per token of a pre-norm block with hidden width ``h`` and MLP width ``f``
(``examples/gpt.py``; SDPA attention, which keeps no ``T x T`` matrix):

=====================  =====================================  ===========
operation              saved for backward                     elements
=====================  =====================================  ===========
ln1                    its input (the residual stream)        h
qkv linear             its input (ln1's output)               h
attention (SDPA)       q, k, v (views of the qkv output),     3h + h
                       its output (proj reads it as a view)
ln2                    its input (residual after attention)   h
fc linear              its input (ln2's output)               h
gelu                   its input (fc's output)                f
proj linear            its input (gelu's output)              f
=====================  =====================================  ===========

That is ``8h + 2f`` elements per token (``16h`` at ``f = 4h``) in the compute dtype, plus
fp32 statistics: two per LayerNorm (mean, 1/std) and one log-sum-exp per head. Residual
additions and zero-probability dropout save nothing. After the blocks: the final norm's
input and output (``2h``) and cross-entropy's log-softmax output (``V`` per token).

The peak comes at the start of backward, when everything above is still saved and the
loss's gradient with respect to the logits (``V``) and the first block's MLP gradients
(``2f``) are live at once.

Tensor parallelism of degree t (Megatron's split, no sequence parallelism) keeps the inputs
of the norms and of the column layers whole (``4h``) and cuts the rest: attention's
``4h``, the MLP's ``2f``, the heads' statistics and the vocabulary (``V``, the
vocabulary-parallel cross-entropy) to 1/t. Ulysses of degree P gives each rank 1/P of the
tokens (attention's q, k, v after the exchange hold the whole sequence for 1/P of the
heads: the same count).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.estimate.shapes import TransformerShape


@dataclass(frozen=True, slots=True)
class ActivationBytes:
    """Activation memory of one micro-batch on one rank.

    Attributes:
        saved: bytes autograd keeps from forward for backward.
        transient: the largest temporaries live on top of ``saved`` (start of backward).
    """

    saved: int
    transient: int

    @property
    def peak(self) -> int:
        """``saved + transient``."""
        return self.saved + self.transient


def gpt_activation_bytes(
    shape: TransformerShape,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int,
    tensor: int = 1,
    sequence: int = 1,
) -> ActivationBytes:
    """Activation bytes of one micro-batch of ``micro_batch`` sequences of ``seq_len``
    tokens, computed in a dtype of ``dtype_bytes`` bytes, on one rank of a tensor group of
    ``tensor`` and a Ulysses group of ``sequence`` ranks (the first, which holds the most).

    Raises:
        ValueError: a non-positive batch or sequence length.
    """
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(
            f"micro batch and sequence length must be >= 1, got {micro_batch} and {seq_len}"
        )
    tokens = micro_batch * -(-seq_len // sequence)  # the first ranks' slices are longer
    h, f, v = shape.hidden, shape.ffn_width, shape.vocab
    split = (4 * h + 2 * f) // tensor
    per_layer = (4 * h + split) * dtype_bytes + (2 * 2 + -(-shape.heads // tensor)) * 4
    head = 2 * h * dtype_bytes + 2 * 4 + v // tensor * dtype_bytes
    saved = tokens * (shape.layers * per_layer + head)
    transient = tokens * (v // tensor + 2 * f // tensor) * dtype_bytes
    return ActivationBytes(saved=saved, transient=transient)
