"""Megatron sequence parallelism: the regions between tensor-parallel blocks split by
sequence.

Between blocks (LayerNorm, dropout, the residual add) every tensor rank would otherwise
compute the same thing on the whole sequence. With sequence parallelism each rank keeps a
slice of the sequence there: a block is entered with ``all_gather_along`` (instead of
``copy_to_group``) and left with ``reduce_scatter_along`` (instead of ``reduce_from_group``),
the same bytes as the all-reduce it replaces, and the activations between blocks take 1/t of
the memory.

The silent bug this invites: a LayerNorm's weight and bias are whole on every tensor rank,
but each rank now computes their gradient from its own slice of the sequence only. Unless
those gradients are summed over the tensor group, each rank's copy steps differently and
the replicas drift apart without any error. The same holds for a row-parallel layer's bias
(whole on every rank, added after the reduce-scatter). :func:`sum_gradients_over_group`
installs that sum on such parameters: one all-reduce per parameter in every backward, from
an autograd hook, which is what a plain PyTorch loop needs. The engine takes these sums
over (:func:`take_over_gradient_sums`) and makes one all-reduce of all of them per
optimizer step, on the reduced gradients (Megatron's ``finalize_model_grads``): the sum
over the tensor group and the one over the data group commute.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from zerotrain.comm.collectives import Communicator

# The parameters whose gradients a hook sums (weakly, by identity: tensors compare by
# value), with their group and hook.
_SUMMED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sum_gradients_over_group(
    params: Iterable[nn.Parameter], comm: Communicator
) -> list[RemovableHandle]:
    """Sum the gradient of each of ``params`` (parameters whole on every rank of ``comm``
    that saw different sequence slices) over ``comm`` as autograd produces it, before it is
    accumulated, so every rank's copy gets the whole sequence's gradient. Returns the hooks
    (``remove()`` them to undo)."""

    def summed(grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        comm.all_reduce(total, purpose="sequence_parallel_gradients")
        return total

    if comm.world_size == 1:
        return []
    seen: set[int] = set()
    hooks = []
    for param in params:
        if param.requires_grad and id(param) not in seen and param not in _SUMMED:
            seen.add(id(param))
            hook = param.register_hook(summed)
            _SUMMED[param] = (comm, hook)
            hooks.append(hook)
    return hooks


def take_over_gradient_sums(
    params: Iterable[torch.Tensor],
) -> dict[Communicator, list[torch.Tensor]]:
    """Remove the hooks :func:`sum_gradients_over_group` installed on any of ``params``,
    and return those parameters by group: the caller now sums their gradients (the engine,
    once per step)."""
    out: dict[Communicator, list[torch.Tensor]] = {}
    for param in params:
        found = _SUMMED.pop(param, None)
        if found is not None:
            comm, hook = found
            hook.remove()
            out.setdefault(comm, []).append(param)
    return out


def restore_gradient_sums(taken: dict[Communicator, list[torch.Tensor]]) -> None:
    """Install the hooks again (the engine could not take the sums over)."""
    for comm, params in taken.items():
        sum_gradients_over_group(params, comm)  # type: ignore[arg-type]
