"""``PipelineModule``: one pipeline rank's share of a model written as a list of layers.

DeepSpeed's names and semantics: the forward pass is the layer list run in order, each
layer's output being the next one's single input (a tensor or a tuple of tensors). The list
is cut into ``num_stages * virtual_stages`` contiguous chunks; chunk ``c`` runs on pipeline
rank ``c % num_stages`` (with ``virtual_stages > 1``, the interleaved schedules' layout).

Every rank computes the same cut from the whole list, building other ranks' layer specs only on
the meta device, and builds for real only its own layers. Local layers are registered under
their *global* index (``"3.attn.qkv.weight"``), so parameter names do not depend on the number
of stages and checkpoints move between pipeline layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from torch import nn

from zerotrain.checkpointing import checkpoint
from zerotrain.parallel.pipeline.layer_run import check_layer_output, layer_seed, needs_grad
from zerotrain.parallel.pipeline.partition import (
    layer_weights,
    partition_balanced,
    partition_uniform,
    trainable_numel,
)
from zerotrain.parallel.pipeline.placement import resolve_placement
from zerotrain.parallel.pipeline.specs import ForwardFn, LayerSpec, TiedLayerSpec
from zerotrain.parallel.pipeline.ties import TIED_PREFIX
from zerotrain.parallel.topology import Topology


@dataclass(frozen=True, slots=True)
class _Entry:
    """What every rank keeps about one entry of the layer list (never another rank's module)."""

    name: str  # class name (or function name), for messages and describe_partition()
    spec: LayerSpec | None  # kept to count parameters on meta on demand
    numel: int | None  # trainable elements, when known without building
    tied_key: str | None


def _describe(layer: Any) -> _Entry:
    if isinstance(layer, TiedLayerSpec):
        return _Entry(layer.typename.__name__, layer, None, layer.key)
    if isinstance(layer, LayerSpec):
        return _Entry(layer.typename.__name__, layer, None, None)
    if isinstance(layer, PipelineModule):
        raise TypeError("a PipelineModule cannot be a layer of another PipelineModule")
    if isinstance(layer, nn.Module):
        return _Entry(type(layer).__name__, None, trainable_numel(layer), None)
    if callable(layer):
        return _Entry(getattr(layer, "__name__", type(layer).__name__), None, 0, None)
    raise TypeError(
        f"pipeline layer {layer!r} ({type(layer).__name__}): a layer must be a LayerSpec, a "
        "TiedLayerSpec, an nn.Module or a callable"
    )


class PipelineModule(nn.Module):
    """The layers of one pipeline rank, cut from the whole model's layer list.

    Args:
        layers: the model as a sequence (an ``nn.Sequential`` works) of ``LayerSpec`` /
            ``TiedLayerSpec`` (built only on the rank that runs them), ``nn.Module`` instances
            (kept only on that rank) and callables (plain functions, kept as they are).
        num_stages: pipeline ranks; may be omitted when ``topology`` is given.
        topology: the rank grid; its ``pipe`` size is the number of stages and, without
            ``stage_id``, this process's pipe coordinate its stage.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage (kept for the executor).
        seed_layers: seed the random generator with ``base_seed + index`` before building
            each layer (restoring it afterwards), so initial values do not depend on the number
            of stages. A tied module uses the index of its key's first occurrence.
        seed_fn: called with the seed instead of seeding torch's CPU generator.
        base_seed: see ``seed_layers``.
        partition_method: ``"parameters"`` (balance trainable parameters), ``"uniform"``
            (balance layer counts) or ``"type:REGEX"`` (balance layers whose class name
            matches); the cut minimises the heaviest chunk exactly.
        activation_checkpoint_interval: checkpoint every group of this many layers (0: none).
        activation_checkpoint_func: ``func(fn, *inputs)``; default
            ``zerotrain.checkpointing.checkpoint``.
        virtual_stages: chunks per rank (zerotrain's extension for interleaved schedules).
        stage_id: this rank's stage, overriding the process group (builds one stage in a
            single process, as tests do).

    Raises:
        ValueError: inconsistent or missing stage counts, a stage outside them, fewer layers
            than chunks, or an unknown ``partition_method``.
        TypeError: a layer that is not a spec, module or callable.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Topology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        virtual_stages: int = 1,
        stage_id: int | None = None,
    ) -> None:
        super().__init__()
        layer_list = list(layers)
        for name, value in (
            ("virtual_stages", virtual_stages),
            ("activation_checkpoint_interval", activation_checkpoint_interval),
        ):
            low = 1 if name == "virtual_stages" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PipelineModule: {name}={value!r}; must be an integer >= {low}")
        self._num_stages, self._topology, self._stage = resolve_placement(
            num_stages, topology, stage_id
        )
        self._virtual = virtual_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or checkpoint
        self._entries = [_describe(layer) for layer in layer_list]

        chunks = self._num_stages * virtual_stages
        if len(layer_list) < chunks:
            raise ValueError(
                f"PipelineModule: {len(layer_list)} layer(s) cannot fill {self._num_stages} "
                f"stage(s) x {virtual_stages} virtual stage(s) = {chunks} chunks; each chunk "
                "needs at least one layer"
            )
        weights = layer_weights(layer_list, partition_method)
        if partition_method.lower() == "uniform":
            self.parts = partition_uniform(len(layer_list), chunks)  # DeepSpeed's exact cut
        else:
            self.parts = partition_balanced(weights, chunks)
        if partition_method.lower() == "parameters":  # counted already: keep for describe
            self._entries = [
                replace(e, numel=int(w)) for e, w in zip(self._entries, weights, strict=True)
            ]
        self.tied_modules = nn.ModuleDict()
        self._tied_attrs: dict[str, tuple[str, ...]] = {}
        self._tied_forward: dict[int, ForwardFn | None] = {}
        self._functions: dict[int, Callable[[Any], Any]] = {}
        self._build(layer_list)

    # -- building -------------------------------------------------------------------------

    def _build(self, layers: Sequence[Any]) -> None:
        first_of_key: dict[str, int] = {}
        for idx, entry in enumerate(self._entries):
            if entry.tied_key is not None:
                first_of_key.setdefault(entry.tied_key, idx)
        for chunk in self.local_chunks():
            for idx in self.chunk_layers(chunk):
                layer = layers[idx]
                if isinstance(layer, TiedLayerSpec):
                    first = first_of_key[layer.key]
                    if layer.key not in self.tied_modules:
                        # Every rank builds from the first occurrence, so the copies agree.
                        owner = layers[first]
                        with layer_seed(self._seed(first), self.seed_fn):
                            self.tied_modules[layer.key] = owner.build()
                        self._tied_attrs[layer.key] = owner.tied_weight_attr
                    self._tied_forward[idx] = layer.forward_fn
                elif isinstance(layer, LayerSpec):
                    with layer_seed(self._seed(idx), self.seed_fn):
                        self.add_module(str(idx), layer.build())
                elif isinstance(layer, nn.Module):
                    self.add_module(str(idx), layer)
                else:
                    self._functions[idx] = layer

    def _seed(self, idx: int) -> int | None:
        return self.base_seed + idx if self.seed_layers else None

    # -- forward ----------------------------------------------------------------------------

    def forward(self, x: Any, chunk: int = 0) -> Any:
        """Run this rank's local chunk ``chunk`` (``0 .. virtual_stages - 1``) on ``x``.

        ``x`` is a tensor or a tuple of tensors, passed to the first layer as one argument.
        With ``activation_checkpoint_interval`` > 0, each group of that many layers runs under
        ``activation_checkpoint_func`` (its inputs splatted, as DeepSpeed does), except when
        nothing in it needs a gradient.

        Raises:
            ValueError: ``chunk`` outside ``0 .. virtual_stages - 1``.
            TypeError: a layer returned something other than a tensor or a tuple/list of
                tensors (named by its global index and class).
        """
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < self._virtual:
            raise ValueError(
                f"chunk={chunk!r}: this rank holds {self._virtual} chunk(s), numbered 0.."
                f"{self._virtual - 1} (global chunks {self.local_chunks()})"
            )
        indices = list(self.chunk_layers(self.local_chunks()[chunk]))
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(indices, x)
        for start in range(0, len(indices), interval):
            group = indices[start : start + interval]
            if needs_grad(x, self._group_parameters(group)):
                packed = isinstance(x, tuple | list)
                args = tuple(x) if packed else (x,)
                x = self.activation_checkpoint_func(partial(self._run_packed, group, packed), *args)
            else:
                x = self._run(group, x)
        return x

    def _run_packed(self, group: list[int], packed: bool, *args: Any) -> Any:
        return self._run(group, args if packed else args[0])

    def _run(self, group: list[int], x: Any) -> Any:
        for idx in group:
            x = check_layer_output(self._call(idx, x), idx, self._entries[idx].name)
        return x

    def _call(self, idx: int, x: Any) -> Any:
        if idx in self._functions:
            return self._functions[idx](x)
        key = self._entries[idx].tied_key
        if key is None:
            return self.get_submodule(str(idx))(x)
        module, forward_fn = self.tied_modules[key], self._tied_forward[idx]
        if forward_fn is None:
            return module(x)
        # Called through the module, not as forward_fn(module, x), so the module's hooks run:
        # ZeRO stage 3 gathers the tied parameters in them (an instance attribute shadows
        # the class's forward for this call).
        module.forward = partial(forward_fn, module)
        try:
            return module(x)
        finally:
            del module.forward

    def _group_parameters(self, group: list[int]) -> list[nn.Parameter]:
        params: list[nn.Parameter] = []
        for idx in group:
            key = self._entries[idx].tied_key
            module = self.tied_modules[key] if key is not None else self._modules.get(str(idx))
            if module is not None:
                params += module.parameters()
        return params

    # -- queries ----------------------------------------------------------------------------

    def zero_unit_modules(self) -> list[tuple[str, nn.Module]]:
        """ZeRO stage 3's units for this stage: each built layer and each tied module (the
        protocol of ``zero/module_units.py``). Naming the tied modules apart keeps their
        parameters in units laid out alike on every stage that holds a copy."""
        units = [
            (name, module)
            for name, module in self.named_children()
            if name != "tied_modules" and any(True for _ in module.parameters())
        ]
        units += [(f"tied_modules.{key}", m) for key, m in self.tied_modules.items()]
        return units

    @property
    def num_stages(self) -> int:
        """Pipeline ranks."""
        return self._num_stages

    @property
    def virtual_stages(self) -> int:
        """Chunks per pipeline rank."""
        return self._virtual

    @property
    def stage_id(self) -> int:
        """This rank's pipe coordinate."""
        return self._stage

    @property
    def topology(self) -> Topology | None:
        """The rank grid (None when built with ``stage_id`` and no topology)."""
        return self._topology

    @property
    def num_layers(self) -> int:
        """Entries of the whole layer list."""
        return len(self._entries)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds chunk 0 (it feeds the model's inputs)."""
        return self._stage == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last chunk (it computes the loss)."""
        return self._stage == self._num_stages - 1

    def stage_chunks(self, stage: int) -> list[int]:
        """Global chunk ids of pipeline rank ``stage``, in execution order."""
        self._check_stage(stage)
        return [stage + k * self._num_stages for k in range(self._virtual)]

    def local_chunks(self) -> list[int]:
        """Global chunk ids on this rank; ``forward(x, chunk=k)`` runs the k-th."""
        return self.stage_chunks(self._stage)

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters local chunk ``chunk`` (``0 .. virtual_stages - 1``) uses, tied
        modules included."""
        return self._group_parameters(list(self.chunk_layers(self.local_chunks()[chunk])))

    def describe_layer(self, idx: int) -> str:
        """``"layer 5 (GPTBlock)"``: how messages name global layer ``idx``."""
        return f"layer {idx} ({self._entries[idx].name})"

    def chunk_layers(self, chunk: int) -> range:
        """Global layer indices of global chunk ``chunk`` (any rank's)."""
        if not 0 <= chunk < len(self.parts) - 1:
            raise ValueError(f"chunk={chunk}: the chunks are 0..{len(self.parts) - 2}")
        return range(self.parts[chunk], self.parts[chunk + 1])

    def tied_keys_of_stage(self, stage: int) -> set[str]:
        """Tied keys with an occurrence on pipeline rank ``stage`` (from the specs, so any
        rank can compute every rank's ties without building them)."""
        return {
            key
            for chunk in self.stage_chunks(stage)
            for idx in self.chunk_layers(chunk)
            if (key := self._entries[idx].tied_key) is not None
        }

    def tied_prefixes(self) -> list[str]:
        """Name prefixes of the tied modules this stage holds: ZeRO stages 0-2 give each a
        unit of its own, so that the copies on different stages line up slice by slice."""
        return sorted(f"{TIED_PREFIX}{key}." for key in self.tied_keys_of_stage(self.stage_id))

    def tied_weight_params(self, key: str) -> list[nn.Parameter]:
        """The parameters named by ``tied_weight_attr`` on this rank's module for ``key``.

        Raises:
            KeyError: ``key`` has no occurrence on this rank.
            TypeError: an attribute that is not an ``nn.Parameter``.
        """
        if key not in self.tied_modules:
            raise KeyError(
                f"tied key {key!r} is not on stage {self._stage}; its tied keys are "
                f"{sorted(self.tied_modules)}"
            )
        params = []
        for attr in self._tied_attrs[key]:
            value: Any = self.tied_modules[key]
            for part in attr.split("."):
                value = getattr(value, part)
            if not isinstance(value, nn.Parameter):
                raise TypeError(
                    f"tied_weight_attr {attr!r} of tied key {key!r} is a "
                    f"{type(value).__name__}, not an nn.Parameter"
                )
            params.append(value)
        return params

    def describe_partition(self) -> str:
        """One line per chunk: its rank, layer range, trainable parameters and layer classes."""
        lines = []
        for chunk in range(len(self.parts) - 1):
            layers = self.chunk_layers(chunk)
            # A tied module is held once however many of its occurrences the chunk has.
            firsts = {self._entries[idx].tied_key or idx: idx for idx in reversed(layers)}
            numel = sum(self._numel(idx) for idx in firsts.values())
            names = ", ".join(self._entries[idx].name for idx in layers)
            lines.append(
                f"chunk {chunk} (stage {chunk % self._num_stages}): layers "
                f"{layers.start}-{layers.stop - 1}, {numel:,} trainable parameters: {names}"
            )
        return "\n".join(lines)

    def _numel(self, idx: int) -> int:
        entry = self._entries[idx]
        if entry.numel is None:
            entry = replace(entry, numel=trainable_numel(entry.spec))
            self._entries[idx] = entry
        return entry.numel or 0

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self._num_stages:
            raise ValueError(f"stage={stage}: the stages are 0..{self._num_stages - 1}")
