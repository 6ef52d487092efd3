"""``engine.offload_states()`` / ``engine.reload_states()``: the engine's side.

Collects the engine's state tensors under DeepSpeed's names, hands them to
``offload.states.StateMover`` (which moves their storage), and keeps the training loop from
touching what is away: the engine's forward, backward, step and checkpoints, the model's own
forward and the optimizer's ``step()`` raise a clear error naming ``reload_states()``
instead of reading freed memory. While ``lp_params`` are offloaded the parameters are views
of their host copy, so reading them (a weight sync to an inference engine, an export) works
as with DeepSpeed; ``.grad`` reads None while ``lp_grads`` are away.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerotrain.offload.states import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    StateMover,
    parse_device,
    parse_include,
)
from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.zero.strategy import ZeroStrategy

log = get_logger(__name__)

# What each entry point reads (contiguous_grad_buffer is reallocated on demand).
FORWARD = frozenset({"lp_params"})
BACKWARD = frozenset({"lp_params", "lp_grads"})
STEP = frozenset({"lp_params", "lp_grads", "hp_params", "optim_states"})
CHECKPOINT = frozenset({"lp_params", "hp_params", "optim_states"})
LOAD = CHECKPOINT | {"lp_grads"}  # loading zeroes the gradients
GRADS = frozenset({"lp_grads"})


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors, and the buffers it keeps beside them (the error
    feedback and momentum of the compressed optimizers: ``state_tensors()``)."""
    tensors = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    extra = getattr(optimizer, "state_tensors", None)
    return tensors + (list(extra()) if callable(extra) else [])


class EngineStates:
    """The offload state of one engine (see the module docstring).

    Args:
        strategy: the engine's units.
        optimizer: the engine's optimizer (None: nothing may be offloaded, as in DeepSpeed).
        module: the model (its forward is refused while its parameters are away).
        offload_configured: ``offload_optimizer`` / ``offload_param`` is set: the states
            already live in host memory or files (refused, as in DeepSpeed).
    """

    def __init__(
        self,
        strategy: ZeroStrategy,
        optimizer: torch.optim.Optimizer | None,
        module: nn.Module,
        offload_configured: bool,
    ) -> None:
        self._strategy = strategy
        self._optimizer = optimizer
        self._module = module
        self._offload_configured = offload_configured
        self._mover = StateMover()
        self._taken_grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._hooks: list[RemovableHandle] = []

    @property
    def offloaded(self) -> frozenset[str]:
        """The state names away from their device now."""
        return self._mover.offloaded

    def _message(self, needed: frozenset[str], call: str) -> str:
        away = sorted(self._mover.offloaded & needed)
        return (
            f"{call} needs {away}, which engine.offload_states() moved out of device memory; "
            "call engine.reload_states() first"
        )

    def require(self, needed: frozenset[str], call: str) -> None:
        """Raise if ``call`` needs a state that is offloaded now."""
        if self._mover.offloaded & needed:
            raise RuntimeError(self._message(needed, call))

    def offload(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | None,
        device: OffloadDeviceEnum | str | torch.device,
        pin_memory: bool,
        non_blocking: bool,
    ) -> None:
        """Move the ``include``d states (all by default) to host memory."""
        target = parse_device(device)
        names = parse_include(include)
        if self._offload_configured:
            raise ValueError(
                "offload_states() with offload_optimizer/offload_param configured: those "
                "states already live in host memory or NVMe files and are moved by the "
                "offloaded step itself (DeepSpeed refuses this combination too)"
            )
        if self._optimizer is None:
            raise ValueError(
                "offload_states() needs an optimizer: the states it moves are the optimizer's "
                "and the gradients it steps (DeepSpeed refuses this too)"
            )
        if target is OffloadDeviceEnum.none:
            log.warning("offload_states(device='none'): nothing moved")
            return
        if target is OffloadDeviceEnum.nvme:
            raise ValueError(
                "offload_states(device='nvme') is not supported (nor by DeepSpeed); use 'cpu'"
            )
        states = self._strategy.offloadable_states()
        chosen: dict[str, list[torch.Tensor]] = {}
        # Parameters first: a storage shared with the master (fp32 training, where the
        # optimizer steps the parameters themselves) then moves as lp_params, and the
        # parameters can be pointed at its copy.
        for name in ("lp_params", "hp_params", "lp_grads"):
            if name in names:
                chosen[name] = states.get(name, [])
        if "optim_states" in names:
            chosen["optim_states"] = _optimizer_tensors(self._optimizer)
        if "lp_grads" in names:
            self._taken_grads += self._strategy.take_param_grads()
        freed = self._mover.offload(chosen, chosen.keys(), pin_memory, non_blocking)
        if "contiguous_grad_buffer" in names:
            before = sum(pool.nbytes for pool in self._strategy.pools)
            self._strategy.drop_idle_staging()
            freed += before - sum(pool.nbytes for pool in self._strategy.pools)
        if "lp_params" in names:
            if non_blocking and self._strategy.comm.device.type == "cuda":
                # The parameters will read the host copy: it must have arrived.
                torch.cuda.current_stream().synchronize()
            self._strategy.point_params(self._mover.host_view)
            if self._strategy.gatherer is not None:  # stage 3: no gather from the shards
                self._strategy.gatherer.refusal = self._message(FORWARD, "a stage-3 gather")
        self._guard()
        log.info(
            "offload_states: %s moved to host memory (%.1f MiB freed on %s)",
            sorted(names),
            freed / 2**20,
            self._strategy.comm.device,
        )

    def reload(self, non_blocking: bool) -> None:
        """Bring every offloaded state back (nothing to do if none is away)."""
        if self._mover.offloaded:
            self._mover.reload(non_blocking)
            self._strategy.point_params(None)
        if self._strategy.gatherer is not None:
            self._strategy.gatherer.refusal = None
        for param, grad in self._taken_grads:
            param.grad = grad
        self._taken_grads = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _guard(self) -> None:
        """Refuse the model's forward and the optimizer's step while what they read is
        away (registered once per offload, removed by reload)."""
        if self._hooks:
            return

        def before_forward(module: nn.Module, args: Any) -> None:
            self.require(FORWARD, "the model's forward")

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.require(STEP, "optimizer.step()")

        # First of the model's pre-hooks: before stage 3's, which would gather the shards.
        self._hooks.append(self._module.register_forward_pre_hook(before_forward, prepend=True))
        if self._optimizer is not None:
            self._hooks.append(self._optimizer.register_step_pre_hook(before_step))
