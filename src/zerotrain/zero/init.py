"""``zerotrain.zero.Init``: build a model whose parameters are never whole on one rank.

Inside the context every ``nn.Parameter`` is created on the meta device (no memory), and
each in-place operation on it (``reset_parameters``, ``nn.init.*``, ``p.data.normal_()``,
``p[0].zero_()``) is recorded in a recipe instead of being applied. To keep the random
stream exactly where normal construction would leave it, each recorded operation also runs
once on a scratch tensor of the parameter's size, which is freed at once, and the generator
state it started from is kept. ``zerotrain.initialize`` (stage 3) later replays each
recipe, one parameter at a time, and keeps only this rank's slice: at no point is more than
one parameter whole, and the values are exactly those of building the model normally with
rank 0's seed, whatever the world size.

Operations that read another parameter or an unmaterialised tensor (``p.copy_(q)``, an
orthogonal init computed on meta tensors) cannot be replayed and raise an error that names
them. Buffers are built normally (they are small and not partitioned).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerotrain.comm.collectives import broadcast_without_engine
from zerotrain.comm.env import init_distributed
from zerotrain.shard.partitioned import replace_storage
from zerotrain.utils.memory import map_large_allocations, release_free_memory

_RECIPE = "_zerotrain_recipe"  # on a parameter built by Init
_TRACKED = "_zerotrain_view"  # on a meta tensor viewing such a parameter: (recipe, chain)

_IDENTITY_VIEWS = (torch.Tensor.data.__get__, torch.Tensor.detach)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Op:
    """One call with a tensor as its subject: a step from a parameter to a view of it, or a
    recorded in-place operation. The subject is the first positional argument, or the
    keyword argument ``key`` (how ``nn.init`` functions hand themselves to a function mode).
    """

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str | None = None

    def run(self, tensor: Any, live: bool = False) -> Any:
        """Call ``func`` on ``tensor`` (``live``: the recording run, which draws from the
        user's generator itself; a replay draws from a copy of its recorded state)."""
        kwargs = {
            k: (v.resolve(live) if isinstance(v, _Replay) else v) for k, v in self.kwargs.items()
        }
        if self.key is None:
            return self.func(tensor, *self.args, **kwargs)
        return self.func(*self.args, **{self.key: tensor}, **kwargs)

    @property
    def name(self) -> str:
        """The function's name."""
        return str(getattr(self.func, "__name__", ""))


Chain = tuple[Op, ...]


class _Replay:
    """A ``generator=`` argument: the user's generator and its state before the op."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.state = generator.get_state()

    def resolve(self, live: bool) -> torch.Generator:
        if live:
            return self.generator
        copy = torch.Generator(device=self.generator.device)
        copy.set_state(self.state)
        return copy


@dataclass(frozen=True)
class _Derived:
    """The value of another parameter (at the time of a ``clone``), through a view chain."""

    source: Recipe
    chain: Chain

    def replay(self) -> torch.Tensor:
        return _apply_chain(self.source.replay(), self.chain)


def _apply_chain(tensor: torch.Tensor, chain: Chain) -> torch.Tensor:
    for op in chain:
        tensor = op.run(tensor)
    return tensor


def _is_in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))


class _Scratch:
    """One buffer, grown to the largest parameter, that recorded operations run on to draw
    their random numbers (a fresh tensor per operation fragments the heap)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


class Recipe:
    """How to compute one parameter: its initial data, then the in-place operations applied
    to it (each with the random-generator state it started from, when it drew numbers)."""

    def __init__(
        self,
        initial: torch.Tensor | _Derived,
        scratch: _Scratch,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.scratch = scratch
        # A non-constant initial tensor is kept whole until the parameter is partitioned
        # (``nn.Parameter(torch.randn(...))`` has no recipe shorter than its values).
        self.initial: torch.Tensor | float | _Derived | None = None
        if isinstance(initial, _Derived):
            self.shape, self.dtype = shape or (), dtype or torch.float32
            self.initial = initial
        else:
            self.shape, self.dtype = tuple(initial.shape), initial.dtype
            if initial.numel() > 0:
                low, high = initial.aminmax() if initial.is_floating_point() else (0, 1)
                constant = bool(low == high)  # ones, zeros, a fill (the usual norm weights)
                self.initial = float(low) if constant else initial.detach().clone()
        self.ops: list[tuple[Chain, Op, torch.Tensor | None]] = []

    def snapshot(self) -> Recipe:
        """A copy that later operations on this parameter do not change."""
        copy = Recipe.__new__(Recipe)
        copy.__dict__.update(self.__dict__)
        copy.ops = list(self.ops)
        return copy

    def record(self, chain: Chain, op: Op) -> None:
        """Note ``op`` (applied to the view ``chain``) and draw the random numbers it draws."""
        state = torch.get_rng_state()
        generator = op.kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            # Replay must draw what this op draws now, from a copy of the generator.
            op = Op(op.func, op.args, {**op.kwargs, "generator": _Replay(generator)}, op.key)
        with torch.no_grad():
            op.run(_apply_chain(self.scratch.get(self.shape, self.dtype), chain), live=True)
        drew = not torch.equal(torch.get_rng_state(), state)
        whole = all(step.func in _IDENTITY_VIEWS for step in chain)
        if whole and op.name in _OVERWRITES:
            self.ops.clear()  # nothing before this op matters any more
            self.initial = None
        self.ops.append((chain, op, state if drew else None))

    def replay(self) -> torch.Tensor:
        """The parameter's full value."""
        full = torch.zeros(self.shape, dtype=self.dtype)
        with torch.no_grad():
            if isinstance(self.initial, torch.Tensor):
                full.copy_(self.initial)
            elif isinstance(self.initial, _Derived):
                full.copy_(self.initial.replay())
            elif self.initial is not None:
                full.fill_(self.initial)
            for chain, op, state in self.ops:
                target = _apply_chain(full, chain)
                if state is None:
                    op.run(target)
                    continue
                saved = torch.get_rng_state()
                torch.set_rng_state(state)
                try:
                    op.run(target)
                finally:
                    torch.set_rng_state(saved)
        return full


# In-place ops that overwrite every element without reading them.
_OVERWRITES = frozenset(
    {
        "normal_",
        "uniform_",
        "fill_",
        "zero_",
        "zeros_",
        "ones_",
        "constant_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "trunc_normal_",
    }
)


def _describe(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))


_CLONES = (torch.Tensor.clone, torch.clone)


def _views(tensor: torch.Tensor, storage: int) -> bool:
    return tensor.device.type == "meta" and tensor.untyped_storage()._cdata == storage


class _RecordMode(TorchFunctionMode):
    """Turns in-place operations on Init-built parameters into recipe entries."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        key = None
        if args and isinstance(args[0], torch.Tensor):
            target: Any = args[0]
        else:
            key = next((k for k in ("tensor", "input") if k in kwargs), None)
            target = kwargs.get(key) if key is not None else None
        if not isinstance(target, torch.Tensor) or not hasattr(target, _TRACKED):
            return func(*args, **kwargs)
        recipe, chain = getattr(target, _TRACKED)
        rest = tuple(args) if key is not None else tuple(args[1:])
        kwargs = {k: v for k, v in kwargs.items() if k != key}
        op = Op(func, rest, kwargs, key)
        if isinstance(kwargs.get("out"), torch.Tensor) and kwargs["out"].device.type == "meta":
            raise NotImplementedError(
                f"zerotrain.zero.Init cannot record {_describe(func)} with out=: write the "
                "result into the parameter with an in-place method (e.g. mul_) instead"
            )
        if func in _CLONES:
            out = func(*args, **kwargs)
            copy = Recipe(_Derived(recipe.snapshot(), chain), recipe.scratch, out.shape, out.dtype)
            setattr(out, _TRACKED, (copy, ()))
            return out
        if _is_in_place(func):
            for value in (*rest, *kwargs.values()):  # what the op reads besides the target
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    raise NotImplementedError(
                        f"zerotrain.zero.Init cannot record {_describe(func)}: it reads "
                        "another parameter or a tensor without values (built on the meta "
                        "device). Initialise that parameter from real tensors, or build the "
                        "model outside zero.Init"
                    )
            copied = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in rest)
            recipe.record(chain, Op(func, copied, kwargs, key))
            return target
        out = op.run(target)
        storage = target.untyped_storage()._cdata
        if isinstance(out, torch.Tensor) and _views(out, storage):
            setattr(out, _TRACKED, (recipe, (*chain, op)))
        elif isinstance(out, (tuple, list)):  # chunk, split, unbind: one view per piece
            for i, piece in enumerate(out):
                if isinstance(piece, torch.Tensor) and _views(piece, storage):
                    setattr(piece, _TRACKED, (recipe, (*chain, op, Op(operator.getitem, (i,), {}))))
        return out


class Init:
    """Context manager: modules built inside have parameters that hold no memory until
    ``zerotrain.initialize`` (ZeRO stage 3) materialises them as this rank's shards.

    Args:
        config: the training config (accepted for DeepSpeed compatibility; the stage is
            read by ``initialize``).
        enabled: False builds the model normally.
        **kwargs: DeepSpeed's other options (``remote_device``, ``pin_memory``, ``dtype``,
            ``mpu``...) are not supported and raise ``TypeError`` when set.

    Every rank must build the same model inside the context: the random stream is rank 0's
    (broadcast on entry), so all ranks record the same values. On exit rank 0's generator is
    where normal construction would have left it; the other ranks get their own back.

    Entering also sets the process's C allocator to map allocations of 1 MiB and more
    individually (``utils.memory.map_large_allocations``, glibc): otherwise the heap keeps
    what recording and replay free, and resident memory grows with the model.
    """

    def __init__(self, config: Any = None, enabled: bool = True, **kwargs: Any) -> None:
        del config
        unsupported = {k: v for k, v in kwargs.items() if v not in (None, False)}
        if unsupported:
            raise TypeError(
                f"zerotrain.zero.Init does not support {sorted(unsupported)}; parameters are "
                "created in their declared dtype on CPU and partitioned by initialize()"
            )
        self.enabled = enabled
        self._mode: _RecordMode | None = None
        self._new: Any = None
        self._own_rng: torch.Tensor | None = None
        self._params: list[nn.Parameter] = []
        self._inits: dict[str, Callable[..., Any]] = {}
        self._scratch = _Scratch()

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        # Recording and later replaying a large model allocates and frees many tensors of a
        # few MiB; mapped individually, they leave nothing behind in the C heap.
        map_large_allocations()
        env = init_distributed()
        state = torch.get_rng_state()
        if env.rank != 0:
            self._own_rng = state.clone()
        broadcast_without_engine([state], src=0)
        torch.set_rng_state(state)
        self._new = nn.Parameter.__new__
        nn.Parameter.__new__ = staticmethod(functools.partial(_new_parameter, self))  # type: ignore[method-assign]
        # nn.init functions are recorded whole: some draw a data-dependent amount of random
        # numbers (trunc_normal_'s rejection sampling), which no meta tensor can follow.
        self._inits = {
            name: getattr(nn.init, name)
            for name in dir(nn.init)
            if name.endswith("_") and not name.startswith("_")
        }
        for name, func in self._inits.items():
            setattr(nn.init, name, functools.partial(_record_init, func))
        self._mode = _RecordMode()
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled or self._mode is None:
            return
        self._mode.__exit__(exc_type, exc, tb)
        nn.Parameter.__new__ = self._new  # type: ignore[method-assign]
        for name, func in self._inits.items():
            setattr(nn.init, name, func)
        for param in self._params:
            if hasattr(param, _TRACKED):
                delattr(param, _TRACKED)
        self._params.clear()
        self._scratch.clear()
        release_free_memory()
        if self._own_rng is not None:
            torch.set_rng_state(self._own_rng)

    def _create(self, cls: type, data: torch.Tensor | None, requires_grad: bool) -> Any:
        if data is None:
            data = torch.empty(0)
        recipe = Recipe(data, self._scratch)
        meta = torch.empty(recipe.shape, dtype=recipe.dtype, device="meta")
        param = self._new(cls, meta, requires_grad)
        setattr(param, _RECIPE, recipe)
        setattr(param, _TRACKED, (recipe, ()))
        self._params.append(param)
        return param


def _record_init(func: Callable[..., Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """An ``nn.init`` function during ``Init``: recorded as one step on a parameter."""
    tag = getattr(tensor, _TRACKED, None)
    if tag is None:
        return func(tensor, *args, **kwargs)
    recipe, chain = tag
    recipe.record(chain, Op(func, args, kwargs))
    return tensor


def _new_parameter(
    init: Init, cls: type, data: torch.Tensor | None = None, requires_grad: bool = True
) -> Any:
    if data is not None and data.device.type == "meta":
        tag = getattr(data, _TRACKED, None)
        if tag is None:
            return init._new(cls, data, requires_grad)  # no recipe: refused by initialize
        recipe, chain = tag
        if chain:  # a view of another parameter, e.g. nn.Parameter(w[0]): a copy of it
            recipe = Recipe(
                _Derived(recipe.snapshot(), chain), recipe.scratch, data.shape, data.dtype
            )
        param = init._new(cls, data, requires_grad)
        setattr(param, _RECIPE, recipe)
        setattr(param, _TRACKED, (recipe, ()))
        init._params.append(param)
        return param
    return init._create(cls, data, requires_grad)


def _value(param: nn.Parameter) -> torch.Tensor:
    recipe = getattr(param, _RECIPE, None)
    if recipe is not None:
        return recipe.replay().to(param.dtype)  # a cast inside Init (.half()) is kept
    if param.is_meta:
        raise NotImplementedError(
            f"a parameter of shape {tuple(param.shape)} was built inside zerotrain.zero.Init "
            "from values it could not record (computed from other parameters, e.g. "
            "weight_norm); build that module outside zero.Init"
        )
    return param.detach()  # an ordinary parameter, added after Init


def deferred_values(model: nn.Module) -> Callable[[nn.Parameter], torch.Tensor] | None:
    """How to compute the values of a model built by ``Init`` (None for an ordinary model).

    Raises:
        NotImplementedError: a parameter built inside Init has no recipe (named).
    """
    params = dict(model.named_parameters())
    if not any(p.is_meta for p in params.values()):
        return None
    missing = [n for n, p in params.items() if p.is_meta and not hasattr(p, _RECIPE)]
    if missing:
        raise NotImplementedError(
            f"parameters {missing} were built inside zerotrain.zero.Init from values it could "
            "not record (computed from other parameters, e.g. weight_norm); build those "
            "modules outside zero.Init"
        )
    return _value


def materialize(model: nn.Module) -> None:
    """Give every parameter of a model built by ``Init`` its full value (for stages 0-2)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_meta:
                replace_storage(param, _value(param))  # the recipe leaves with the old data
