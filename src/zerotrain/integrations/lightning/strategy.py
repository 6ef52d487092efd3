"""``ZeroTrainStrategy``: a LightningModule trained by a zerotrain engine (ZeRO stages 0-3).

Lightning keeps its loop: which batches accumulate and which step (the last batch of an
epoch always steps, as with DDP), the hooks, the schedules, the callbacks. The engine does
the rest, once: the division of the loss over the accumulation window, the reduction across
ranks, clipping, mixed precision and fp16 loss scaling, and the optimizer step. Lightning's
decision is handed to the engine micro-step by micro-step through
``engine.set_gradient_accumulation_boundary``, so an epoch whose length is not a multiple of
``accumulate_grad_batches`` ends exactly as under DDP.

Process launching, the process group, ``barrier``/``broadcast``/``reduce`` and the
distributed sampler come from Lightning's ``DDPStrategy``; the model is never wrapped in DDP.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

import zerotrain
from zerotrain.checkpoint.consolidate import load_state_dict_from_checkpoint
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.engine.engine import Engine
from zerotrain.integrations.lightning.client_state import client_state
from zerotrain.integrations.lightning.config import engine_config, load_strategy_config
from zerotrain.integrations.lightning.precision import ZeroTrainPrecision
from zerotrain.integrations.lightning.schedulers import rebind_schedulers
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

# The tag under a Lightning checkpoint path: Lightning names the checkpoint, the engine
# writes ``<path>/checkpoint/`` and ``<path>/latest``.
CHECKPOINT_TAG = "checkpoint"


class ZeroTrainStrategy(DDPStrategy):
    """Train a LightningModule with zerotrain's ZeRO data parallelism.

    ``Trainer(strategy="zerotrain_stage_2")`` or ``Trainer(strategy=ZeroTrainStrategy(stage=2,
    config={...}))``. The Trainer's ``accumulate_grad_batches``, ``gradient_clip_val`` and
    ``precision`` become the engine's ``gradient_accumulation_steps``, ``gradient_clipping``
    and ``bf16``/``fp16`` sections; the optimizer of ``configure_optimizers`` is handed to
    ``zerotrain.initialize`` (rebuilt over this rank's shards when states are partitioned)
    and its schedules are stepped by Lightning. Checkpoints are zerotrain's sharded
    directories, loadable at another world size.

    Args:
        stage: the ZeRO stage (0-3); None takes the config's (else zerotrain's default).
        config: more of the engine's config, DeepSpeed-style: a dict or a JSON file path
            (``zero_optimization`` options, ``train_micro_batch_size_per_gpu``, an
            ``optimizer``/``scheduler`` section used when ``configure_optimizers`` gives
            none, ...). Keys the Trainer owns must agree with the Trainer's arguments.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``
            (``timeout``: its default, the collective timeout of the process group).
    """

    strategy_name = "zerotrain"

    def __init__(
        self,
        stage: int | None = None,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.stage = stage
        self.config = load_strategy_config(config)
        self.engine: Engine | None = None
        # Inside Lightning's block_backward_sync: this micro-batch accumulates.
        self._accumulating = False
        # The loss training_step returned, before Lightning divides it by
        # accumulate_grad_batches: the engine divides (once) itself.
        self._step_loss: torch.Tensor | None = None
        self._failed = False

    # -- precision: Lightning's choice, the engine's math ----------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        """Always a :class:`ZeroTrainPrecision` (the Trainer's own plugin is converted)."""
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroTrainPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else ZeroTrainPrecision.adopt(plugin)

    # -- set-up and teardown ---------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        """Lightning's launcher; when it starts the ranks itself, zerotrain's shared-memory
        collectives are turned off (``ZEROTRAIN_SHM=0``, inherited by the ranks it starts):
        with ranks started by Lightning's launcher they exchanged misplaced data in the
        first collective of ``initialize`` (found on gloo/CPU; torchrun-started and
        ``run_distributed`` ranks are unaffected). Gloo carries the collectives instead."""
        super()._configure_launcher()
        env = self.cluster_environment
        launched_here = env is not None and not env.creates_processes_externally
        if launched_here and self.num_processes > 1:
            os.environ.setdefault("ZEROTRAIN_SHM", "0")

    def setup_environment(self) -> None:
        """Tell zerotrain the device Lightning chose, then join the process group."""
        wanted = self.root_device.type
        chosen = os.environ.setdefault("ZEROTRAIN_DEVICE", wanted)
        if chosen != wanted:
            raise ValueError(
                f"ZEROTRAIN_DEVICE={chosen} but the Trainer's accelerator puts this rank on "
                f"{self.root_device}: unset ZEROTRAIN_DEVICE or make them agree"
            )
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        """Fitting: build the engine around the LightningModule. Evaluating or predicting:
        the plain model on every rank (nothing to reduce, and stage 3 would gather every
        unit anyway)."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_engine(trainer)
        else:
            self.model_to_device()
        self.setup_precision_plugin()

    def _setup_engine(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "ZeroTrainStrategy needs automatic optimization (the engine owns backward, "
                "accumulation and the step); manual optimization is not supported yet"
            )
        for hook in ("backward", "configure_gradient_clipping"):
            if is_overridden(hook, module, pl.LightningModule):
                log.warning(
                    "%s.%s is overridden but not called: the zerotrain engine runs backward "
                    "and clips (Trainer(gradient_clip_val=...))",
                    type(module).__name__,
                    hook,
                )
        self.setup_optimizers(trainer)  # Lightning reads configure_optimizers
        if len(self.optimizers) > 1:
            raise MisconfigurationException(
                f"ZeroTrainStrategy steps one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        client = self.optimizers[0] if self.optimizers else None
        config = engine_config(
            self.config,
            stage=self.stage,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            precision=str(self.precision_plugin.precision),
        )
        engine, optimizer, _, scheduler = zerotrain.initialize(
            model=module, optimizer=client, config=config
        )
        if engine.device != self.root_device:
            engine.destroy(restore_params=False)
            raise RuntimeError(
                f"rank {self.global_rank}: zerotrain placed the model on {engine.device} but "
                f"Lightning's device for this rank is {self.root_device} (LOCAL_RANK picks "
                "the GPU): give the Trainer devices that match the local ranks"
            )
        self.engine = engine
        self.model = engine
        self.optimizers = [optimizer] if optimizer is not None else []
        if optimizer is not None and client is not None and optimizer is not client:
            rebind_schedulers(self.lr_scheduler_configs, optimizer)
        # A schedule from the config's own section is the engine's to step; those of
        # configure_optimizers are Lightning's (lr_scheduler_configs).
        del scheduler

    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: teardown then releases the engine without collectives
        (the other ranks may never reach them)."""
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Give the model back whole (trained weights; fp32 masters under mixed precision),
        so evaluation, ``predict`` or plain PyTorch can use it after ``fit``."""
        if self.engine is not None:
            self.engine.destroy(restore_params=not self._failed)
            self.engine = None
            self.model = self.lightning_module
        super().teardown()

    # -- one micro-step --------------------------------------------------------------------------

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError(
                f"rank {self.global_rank}: the zerotrain engine exists only while fitting"
            )
        return self.engine

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training_step through the engine (casts, stage-3 gathers); keeps
        the undivided loss for :meth:`backward`."""
        output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        self._step_loss = loss if isinstance(loss, torch.Tensor) else None
        return output

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning marks the micro-batches that accumulate with this context."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def backward(
        self,
        closure_loss: torch.Tensor,
        optimizer: Optimizer | None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The engine's backward on the loss training_step returned (Lightning's
        ``closure_loss`` is already divided by ``accumulate_grad_batches``; the engine
        divides by its ``gradient_accumulation_steps``, the same number, itself). A
        micro-batch that accumulates is finished here; the window's last one is stepped by
        :meth:`optimizer_step`."""
        engine = self._require_engine()
        module = self.lightning_module
        assert module is not None
        loss, self._step_loss = self._step_loss, None
        if loss is None:
            raise RuntimeError(
                f"rank {self.global_rank}: backward without a training_step loss: "
                "ZeroTrainStrategy supports automatic optimization only"
            )
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        boundary = not self._accumulating
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss)
        if not boundary:
            engine.step()  # counts the micro-step; the update waits for the window's end
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The window's last micro-batch (closure: training_step and backward), the hooks
        before an optimizer step, then the engine's step: clip, update, zero."""
        engine = self._require_engine()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        engine.step()
        return output

    # -- checkpoints: the engine's sharded directories -------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The engine must exist to load its states into."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The engine restores optimizer states (resharded to this world size)."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty while the engine holds the weights (it saves them, sharded)."""
        if self.engine is not None:
            return {}
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """Empty while the engine holds the optimizer (it saves the states, sharded)."""
        if self.engine is not None:
            return {}
        return super().optimizer_state(optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write zerotrain's sharded checkpoint directory at ``filepath`` (collective: every
        rank writes its shards); Lightning's loop, callback and schedule states go in as
        ``client_state``. Without an engine (after ``fit``) Lightning's own single file."""
        if self.engine is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(storage_options=...) is not supported by "
                "ZeroTrainStrategy: the engine writes the checkpoint directory itself"
            )
        filepath = self.broadcast(filepath)  # every rank writes into rank 0's path
        self.engine.save_checkpoint(
            filepath, tag=CHECKPOINT_TAG, client_state=client_state(checkpoint)
        )

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Fitting: load the engine's states (any saving world size and stage) and return
        Lightning's part. Otherwise: the consolidated weights as ``state_dict``."""
        del weights_only  # the engine reads tensors only; client_state loads weights_only
        path = Path(checkpoint_path)
        if not path.is_dir():
            raise ValueError(
                f"{path} is not a zerotrain checkpoint directory (ZeroTrainStrategy saves "
                "a directory per checkpoint); load a single-file Lightning checkpoint into "
                "the model before fitting instead"
            )
        module = self.lightning_module
        assert module is not None
        if self.engine is None:
            reader = CheckpointReader.open(path)
            state = _read_client_state(reader)
            state["state_dict"] = load_state_dict_from_checkpoint(path)
            return state
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        _, state = self.engine.load_checkpoint(
            path, load_optimizer_states=fitting, strict=module.strict_loading
        )
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds no Lightning state: it was not saved by a Trainer")
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing while the engine exists: its load_checkpoint restored the weights."""
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: the engine's load_checkpoint restored the optimizer states."""

    # -- names ----------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"zerotrain"`` (the config's stage) and ``"zerotrain_stage_0"`` ... ``_3``."""
        strategy_registry.register(
            "zerotrain", cls, description="zerotrain ZeRO data parallelism", override=True
        )
        for stage in range(4):
            strategy_registry.register(
                f"zerotrain_stage_{stage}",
                cls,
                description=f"zerotrain ZeRO stage {stage}",
                override=True,
                stage=stage,
            )


def _read_client_state(reader: CheckpointReader) -> dict[str, Any]:
    name = reader.manifest.client_state
    if name is None:
        return {}
    state = torch.load(reader.path / name, weights_only=True)
    return dict(state) if isinstance(state, Mapping) else {}
