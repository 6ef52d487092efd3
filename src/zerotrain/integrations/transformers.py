"""``ZeroTrainTrainer``: the transformers ``Trainer`` training through a zerotrain engine,
without DeepSpeed installed.

    from zerotrain.integrations.transformers import ZeroTrainTrainer
    trainer = ZeroTrainTrainer(model=model, args=args, train_dataset=data,
                               zerotrain_config={"zero_optimization": {"stage": 3}})
    trainer.train()

The Trainer keeps its own loop, optimizer, schedule, logging and data; the engine replaces
what DDP (or DeepSpeed) would do, and nothing is done twice:

* the config's batch, accumulation, clipping and precision keys are filled from
  ``TrainingArguments`` where they are ``"auto"`` or missing, and must agree with them
  otherwise; without ``optimizer`` / ``scheduler`` sections the Trainer's optimizer and
  schedule are used; with them the engine builds both from the config, their ``"auto"``
  values filled as transformers' DeepSpeed integration fills them (``lr``, ``betas``,
  ``eps``, ``weight_decay`` from the arguments; ``warmup_min_lr`` 0, ``warmup_max_lr`` the
  learning rate, ``warmup_num_steps`` and ``total_num_steps`` from the run's length), and
  the Trainer's schedule is the engine's (stepped once, by the engine); ``"auto"`` bucket
  sizes come from the model's ``hidden_size`` (``reduce_bucket_size`` hidden², stage 3's
  prefetch 0.9 hidden², persistence threshold 10 hidden);
* the Trainer decides the accumulation windows (a short last window at an epoch's end
  included) and divides the loss by the window's length; the engine is told both
  (``set_gradient_accumulation_boundary``, ``backward(scale_wrt_gas=False)``), so the
  gradient equals the Trainer's own under DDP;
* ``optimizer.step()`` of the Trainer is the engine's step (clipping there, once); the
  Trainer's schedule moves the engine optimizer's rates, and the logged rate is the one the
  step used;
* ``save_model`` writes the whole model from rank 0 (ties kept; at stage 3 gathered one
  module at a time); Trainer checkpoints hold a zerotrain checkpoint beside the model, so
  ``resume_from_checkpoint`` continues exactly, also at another world size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch
from transformers import Trainer

import zerotrain
from zerotrain.config.source import parse_json_text
from zerotrain.engine.engine import Engine
from zerotrain.engine.model_export import consolidated_state_dict
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

ENGINE_CHECKPOINT = "zerotrain"  # folder of a Trainer checkpoint holding the engine's
SCHEDULER_FILE = "scheduler.pt"


class _EngineStep(torch.optim.Optimizer):
    """What the Trainer steps: the engine's optimizer, whose ``step()`` is the engine's
    (clip, update, zero the gradients). Its param groups are the engine optimizer's, so
    the Trainer's schedule sets the rates the engine uses."""

    def __init__(self, engine: Engine) -> None:
        # Optimizer.__init__ is not called: this object owns no parameters or state.
        self.engine = engine
        self.inner: Any = engine.optimizer
        self.defaults = getattr(self.inner, "defaults", {})
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    # Looked up each time: loading a checkpoint may give the engine's optimizer new groups.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        del closure
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the engine zeroes its window at every step

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def filled_config(
    source: dict[str, Any] | str | os.PathLike[str] | None, args: Any
) -> dict[str, Any]:
    """``source`` with ``"auto"`` and missing keys taken from ``TrainingArguments``; a set
    value that contradicts them is refused, naming both."""
    if source is None:
        source = {}
    elif not isinstance(source, dict):
        source = parse_json_text(Path(source).read_text(), str(source))
    config: dict[str, Any] = json.loads(json.dumps(source))  # a deep copy
    optimizer = config.get("optimizer", {}).get("params")
    if isinstance(optimizer, dict):
        for key, value in {
            "lr": args.learning_rate,
            "betas": [args.adam_beta1, args.adam_beta2],
            "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay,
        }.items():
            _fill(optimizer, key, value, f"optimizer.params.{key}")
    scheduler = config.get("scheduler", {}).get("params")
    if isinstance(scheduler, dict):
        _fill(scheduler, "warmup_min_lr", 0, "scheduler.params.warmup_min_lr")
        _fill(scheduler, "warmup_max_lr", args.learning_rate, "scheduler.params.warmup_max_lr")
    wanted = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
    }
    for key, value in wanted.items():
        config.setdefault(key, "auto")  # missing: taken from the arguments too
        _fill(config, key, value, key)
    # Follows from the two above and the world size: checked, not silently dropped.
    total = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    given = config.pop("train_batch_size", "auto")
    if given not in ("auto", total):
        raise ValueError(
            f"zerotrain_config train_batch_size={given!r} disagrees with TrainingArguments "
            f"(per_device_train_batch_size x gradient_accumulation_steps x world size = "
            f'{total}); set it to "auto" or to {total}'
        )
    for name, flag in (("bf16", args.bf16), ("fp16", args.fp16)):
        section = config.setdefault(name, {})
        enabled = section.get("enabled", "auto")
        if enabled not in ("auto", flag):
            raise ValueError(
                f"zerotrain_config {name}.enabled={enabled!r} disagrees with "
                f"TrainingArguments.{name}={flag}"
            )
        section["enabled"] = bool(flag)
    return config


def _fill(section: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Set ``section[key]`` to ``value`` where it is ``"auto"``; a set value that differs
    is refused, as transformers' DeepSpeed integration refuses it."""
    given = section.get(key)
    if given == "auto":
        section[key] = value
    elif (
        key in section and given != value and not (isinstance(given, list) and list(value) == given)
    ):
        raise ValueError(
            f"zerotrain_config {where}={given!r} disagrees with TrainingArguments ({value!r}); "
            'set it to "auto" or to the same value'
        )


def finalized_config(config: dict[str, Any], args: Any, model: Any, steps: int) -> dict[str, Any]:
    """``config`` (from :func:`filled_config`) with the ``"auto"`` values that need the run's
    length (``steps`` optimizer steps) and the model: the schedule's warm-up and total
    steps, and bucket sizes from the model's ``hidden_size``."""
    config = json.loads(json.dumps(config))
    scheduler = config.get("scheduler", {}).get("params")
    if isinstance(scheduler, dict):
        _fill(scheduler, "total_num_steps", steps, "scheduler.params.total_num_steps")
        warmup = args.get_warmup_steps(steps)
        _fill(scheduler, "warmup_num_steps", warmup, "scheduler.params.warmup_num_steps")
    zero = config.get("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": lambda h: h * h,
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    wanted = [key for key in sizes if zero.get(key) == "auto"]
    if wanted:
        model_config = getattr(model, "config", None)
        hidden = getattr(model_config, "hidden_size", None)
        if hidden is None and getattr(model_config, "hidden_sizes", None):
            hidden = max(model_config.hidden_sizes)  # type: ignore[union-attr]
        if hidden is None:
            raise ValueError(
                f'zerotrain_config zero_optimization.{wanted[0]} is "auto", which is filled '
                "from the model config's hidden_size, and this model's config has none: set "
                "it to a number"
            )
        for key in wanted:
            zero[key] = sizes[key](int(hidden))
    if zero.get("stage3_gather_16bit_weights_on_model_save") == "auto":
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # accelerate's default
    return config


class _EngineSchedule:
    """The Trainer's view of the schedule the engine builds from the config: the engine
    steps it with each optimizer step, so the Trainer's ``step()`` does nothing."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler: Any = engine.lr_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.engine.get_lr_of_last_step()]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


# transformers is not type-checked (pyproject.toml: reading it took half of a cold mypy run),
# so Trainer is Any here and the attributes this class sets are declared below.
class ZeroTrainTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` whose training runs through a zerotrain engine.

    Args:
        zerotrain_config: the zerotrain (DeepSpeed-style) config, a dict or a JSON path;
            batch, accumulation, clipping and precision come from ``TrainingArguments``
            (``"auto"``), and so do the ``"auto"`` values of ``optimizer`` and ``scheduler``
            sections, which the engine then builds.
        *args, **kwargs: as for ``Trainer``.
    """

    optimizer: Any
    lr_scheduler: Any
    model_wrapped: Any

    def __init__(
        self,
        *args: Any,
        zerotrain_config: dict[str, Any] | str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.zerotrain_config = filled_config(zerotrain_config, self.args)
        self.engine: Engine | None = None

    # -- the engine in the Trainer's loop --------------------------------------------------

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        # A model loaded inside zero.Init has no values yet (its parameters are on the meta
        # device, recorded): initialize computes and places them, partitioned.
        params = list(model.parameters())
        if params and all(p.is_meta for p in params):
            return
        super()._move_model_to_device(model, device)

    def create_optimizer(self, model: Any = None) -> Any:
        if "optimizer" in self.zerotrain_config:
            return self.optimizer  # the engine builds it from the config
        return super().create_optimizer(model)

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if not training:
            return self.engine if self.engine is not None else model
        if self.engine is None:
            if self.optimizer is None:
                self.create_optimizer()
            config = finalized_config(
                self.zerotrain_config, self.args, self.model, self.state.max_steps
            )
            engine, _, _, _ = zerotrain.initialize(
                model=self.model, optimizer=self.optimizer, config=config
            )
            self.engine = engine
            # The Trainer builds its schedule on this, after wrapping (so over the
            # engine's optimizer, rebuilt over the shards at stages 1-3).
            self.optimizer = _EngineStep(engine)
            if "scheduler" in config:
                self.lr_scheduler = _EngineSchedule(engine)
        return self.engine

    def training_step(
        self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        engine = self.engine
        if engine is None or model is not engine:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = cast(
                torch.Tensor,
                self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch),
            )
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # The Trainer's window (a short one at an epoch's end too) and its division. Its
        # micro-batches before the last run inside accelerate's no_sync, which is the
        # engine's: they accumulate locally and the last backward reduces them all; the
        # Trainer's optimizer.step() then steps the engine.
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        engine.backward(loss, scale_wrt_gas=False)
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Any:
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return None  # the engine clips (gradient_clipping = max_grad_norm) in its step

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()  # of the previous step: this one is ahead

    # -- saving and resuming --------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Collective at stage 3; a copy on rank 0 whose ties are one tensor under each name
        # (the engine's parameters are views of flat buffers, which save_pretrained would
        # take for tied weights).
        state = consolidated_state_dict(self.engine)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT), tag="state")
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.engine is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the weights come with the engine's checkpoint (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self.engine.load_checkpoint(
            os.path.join(checkpoint, ENGINE_CHECKPOINT), tag="state", load_lr_scheduler_states=False
        )
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.exists(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self.engine is not None:
                # The model holds its trained weights whole again (as after DDP training);
                # a later train() builds a new engine.
                self.engine.destroy()
                self.engine = None
                self.optimizer = None
                self.lr_scheduler = None
                self.model_wrapped = self.model
