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

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.comm.collectives import Communicator
from zerotrain.shard.partitioned import replace_storage
from zerotrain.utils.memory import (
    LargeAllocationMapping,
    map_large_allocations,
    release_free_memory,
)
from zerotrain.utils.torch_compat import storage_id
from zerotrain.zero.init_args import check_init_arguments, load_init_config

# Side tables, never attributes on tensors. A parameter built by Init -> its recipe, until
# initialize computes its value (held weakly: a model dropped before that takes its recipes
# with it). This is the only process-wide table of this module.
_RECIPES: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Inside one Init, each Init keeps its own: meta tensor viewing a parameter -> (recipe, chain).

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
    return tensor.device.type == "meta" and storage_id(tensor) == storage


class _RecordMode(TorchFunctionMode):
    """Turns in-place operations on Init-built parameters into recipe entries.

    ``tracked`` maps each meta tensor that views such a parameter to its recipe and the
    chain of views from the parameter to it."""

    def __init__(self, tracked: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.tracked = tracked

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
        tag = self.tracked.get(target) if isinstance(target, torch.Tensor) else None
        if tag is None:
            return func(*args, **kwargs)
        recipe, chain = tag
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
            self.tracked[out] = (copy, ())
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
        storage = storage_id(target)
        if isinstance(out, torch.Tensor) and _views(out, storage):
            self.tracked[out] = (recipe, (*chain, op))
        elif isinstance(out, (tuple, list)):  # chunk, split, unbind: one view per piece
            for i, piece in enumerate(out):
                if isinstance(piece, torch.Tensor) and _views(piece, storage):
                    self.tracked[piece] = (recipe, (*chain, op, Op(operator.getitem, (i,), {})))
        return out


class Init:
    """Context manager: modules built inside have parameters that hold no memory until
    ``zerotrain.initialize`` (ZeRO stage 3) materialises them as this rank's shards.

    Args (DeepSpeed's; ``zero/init_args.py`` checks them):
        module: a model built already; accepted, nothing to do (``initialize`` partitions
            whatever model it gets).
        config_dict_or_path: the training config (dict or JSON path), validated here;
            ``config`` is its older name. Partitioning and placement follow the config
            given to ``initialize``.
        enabled: False builds the model normally.
        remote_device: ``"cpu"``/``"nvme"``/``"none"``: must agree with the config's
            ``zero_optimization.offload_param.device`` (which places the shards).
        pin_memory, mem_efficient_linear: accepted; no effect.
        dtype: fp32 or the config's bf16/fp16 compute dtype (``initialize`` casts to it).
        mpu: accepted; the ZeRO group comes from ``initialize``.
        data_parallel_group, zero_param_parallel_group, sequence_data_parallel_group,
            zero_quantized_weights, zero_quantized_nontrainable_weights, param_swapper:
            refused when set (``ValueError``).

    Every rank must build the same model inside the context. Each records the random
    states its operations drew from; ``initialize`` replaces them with rank 0's (of each
    ZeRO group) before computing values, so every rank computes rank 0's values whatever
    its own seed, and Init itself needs no process group. On exit each rank's generator is
    where normal construction would have left it. ``nn.Parameter.__new__`` and the
    ``nn.init`` functions are redirected only inside the context (and restored if entering
    fails); which tensor belongs to which recipe is kept in side tables, never in
    attributes on the tensors.

    Inside the context the process's C allocator maps allocations of 1 MiB and more
    individually (``utils.memory.map_large_allocations``, glibc), and again while
    ``initialize`` replays the recipes: otherwise the heap keeps what recording and replay
    free, and resident memory grows with the model. Each hold is released when its part
    is done.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        # mem_efficient_linear and pin_memory choose DeepSpeed kernels and host buffers;
        # zerotrain has neither here (offload_param.pin_memory governs pinning).
        del mem_efficient_linear, pin_memory
        check_init_arguments(
            load_init_config(config_dict_or_path, config),
            module=module,
            data_parallel_group=data_parallel_group,
            remote_device=remote_device,
            dtype=dtype,
            mpu=mpu,
            zero_param_parallel_group=zero_param_parallel_group,
            zero_quantized_weights=zero_quantized_weights,
            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
            sequence_data_parallel_group=sequence_data_parallel_group,
            param_swapper=param_swapper,
        )
        self.enabled = enabled
        self._mode: _RecordMode | None = None
        self._new: Any = None
        self._tracked = WeakIdKeyDictionary()  # meta tensor -> (recipe, chain)
        self._inits: dict[str, Callable[..., Any]] = {}
        self._scratch = _Scratch()
        self._mapping: LargeAllocationMapping | None = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        # Recording a large model allocates and frees many tensors of a few MiB; mapped
        # individually, they leave nothing behind in the C heap.
        self._mapping = map_large_allocations()
        # The class's own entry (a staticmethod), so the exit puts back the very object:
        # assigning the bare function back would leave a different ``__new__`` behind.
        self._new = vars(nn.Parameter)["__new__"]
        # nn.init functions are recorded whole: some draw a data-dependent amount of random
        # numbers (trunc_normal_'s rejection sampling), which no meta tensor can follow.
        self._inits = {
            name: getattr(nn.init, name)
            for name in dir(nn.init)
            if name.endswith("_") and not name.startswith("_")
        }
        try:
            nn.Parameter.__new__ = staticmethod(functools.partial(_new_parameter, self))  # type: ignore[method-assign]
            for name, func in self._inits.items():
                setattr(nn.init, name, functools.partial(_record_init, self, func))
            self._mode = _RecordMode(self._tracked)
            self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        nn.Parameter.__new__ = self._new  # type: ignore[method-assign]
        for name, func in self._inits.items():
            setattr(nn.init, name, func)
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled or self._mode is None:
            return
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            self._mode = None
            self._restore()
            self._tracked.clear()
            self._scratch.clear()
            release_free_memory()

    def _adopt(self, param: nn.Parameter, recipe: Recipe) -> nn.Parameter:
        _RECIPES[param] = recipe
        self._tracked[param] = (recipe, ())
        return param

    def _create(self, cls: type, data: torch.Tensor | None, requires_grad: bool) -> Any:
        if data is None:
            data = torch.empty(0)
        recipe = Recipe(data, self._scratch)
        meta = torch.empty(recipe.shape, dtype=recipe.dtype, device="meta")
        return self._adopt(self._new(cls, meta, requires_grad), recipe)


def _record_init(
    init: Init, func: Callable[..., Any], tensor: Any, *args: Any, **kwargs: Any
) -> Any:
    """An ``nn.init`` function during ``Init``: recorded as one step on a parameter."""
    tag = init._tracked.get(tensor) if isinstance(tensor, torch.Tensor) else None
    if tag is None:
        return func(tensor, *args, **kwargs)
    recipe, chain = tag
    recipe.record(chain, Op(func, args, kwargs))
    return tensor


def _new_parameter(
    init: Init, cls: type, data: torch.Tensor | None = None, requires_grad: bool = True
) -> Any:
    if data is not None and data.device.type == "meta":
        tag = init._tracked.get(data)
        if tag is None:
            return init._new(cls, data, requires_grad)  # no recipe: refused by initialize
        recipe, chain = tag
        if chain:  # a view of another parameter, e.g. nn.Parameter(w[0]): a copy of it
            recipe = Recipe(
                _Derived(recipe.snapshot(), chain), recipe.scratch, data.shape, data.dtype
            )
        return init._adopt(init._new(cls, data, requires_grad), recipe)
    return init._create(cls, data, requires_grad)


class DeferredValues:
    """The values of a model built by ``Init``, computed one parameter at a time.

    Taking the recipes out of the process-wide table ends every weak reference to the
    parameters (``torch.utils.swap_tensors``, which partitioning uses, refuses a tensor
    that has one); they now live as long as this object.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._recipes: dict[int, Recipe] = {}
        for param in params:
            recipe = _RECIPES.pop(param, None)
            if recipe is not None:
                self._recipes[id(param)] = recipe

    def __call__(self, param: nn.Parameter) -> torch.Tensor:
        """The full value of ``param``."""
        recipe = self._recipes.get(id(param))
        if recipe is not None:
            return recipe.replay().to(param.dtype)  # a cast inside Init (.half()) is kept
        if param.is_meta:
            raise NotImplementedError(
                f"a parameter of shape {tuple(param.shape)} was built inside "
                "zerotrain.zero.Init from values it could not record (computed from other "
                "parameters, e.g. weight_norm); build that module outside zero.Init"
            )
        return param.detach()  # an ordinary parameter, added after Init

    def share_random_state(self, comms: Sequence[Communicator]) -> None:
        """Give every rank rank 0's recorded random states and initial values (collective
        over each of ``comms`` in turn), so that all of them compute rank 0's values.
        Every rank must have built the same model."""
        found: dict[int, torch.Tensor] = {}
        for recipe in self._recipes.values():
            _random_inputs(recipe, found)
        tensors = list(found.values())
        for comm in comms:
            if comm.world_size > 1:
                broadcast_tensors(comm, tensors, _SHARE_BUCKET_NUMEL, src=0)


def deferred_values(model: nn.Module) -> DeferredValues | None:
    """How to compute the values of a model built by ``Init`` (None for an ordinary model).

    Raises:
        NotImplementedError: a parameter built inside Init has no recipe (named).
    """
    params = dict(model.named_parameters())
    if not any(p.is_meta for p in params.values()):
        return None
    missing = [n for n, p in params.items() if p.is_meta and p not in _RECIPES]
    if missing:
        raise NotImplementedError(
            f"parameters {missing} were built inside zerotrain.zero.Init from values it could "
            "not record (computed from other parameters, e.g. weight_norm); build those "
            "modules outside zero.Init"
        )
    return DeferredValues(list(params.values()))


_SHARE_BUCKET_NUMEL = 50_000_000


def _random_inputs(recipe: Recipe, found: dict[int, torch.Tensor]) -> None:
    """The tensors ``recipe`` replays from that a rank drew itself: generator states and
    non-constant initial values (keyed by id: snapshots share them)."""
    if isinstance(recipe.initial, torch.Tensor):
        found.setdefault(id(recipe.initial), recipe.initial)
    elif isinstance(recipe.initial, _Derived):
        _random_inputs(recipe.initial.source, found)
    for _, op, state in recipe.ops:
        if state is not None:
            found.setdefault(id(state), state)
        for value in op.kwargs.values():
            if isinstance(value, _Replay):
                found.setdefault(id(value.state), value.state)


def replaying(values: object | None) -> LargeAllocationMapping | None:
    """A hold on mapping large allocations individually for as long as parameter values
    computed from ``values`` (``Init``'s recipes) are in use, or None for an ordinary model
    (``values`` None): replaying allocates and frees tensors of a few MiB, which would
    otherwise stay behind in the C heap. Release it (``with`` or ``release()``)."""
    return None if values is None else map_large_allocations()


def materialize(model: nn.Module, values: DeferredValues) -> None:
    """Give every parameter of a model built by ``Init`` its full value (for stages 0-2)."""
    with torch.no_grad(), replaying(values) or contextlib.nullcontext():
        for param in model.parameters():
            if param.is_meta:
                replace_storage(param, values(param))
