"""PyTorch Lightning integration: ``Trainer(strategy="zerotrain_stage_3")``.

Importing this module registers the strategy names ``"zerotrain"`` and
``"zerotrain_stage_0"`` ... ``"zerotrain_stage_3"`` with Lightning::

    import zerotrain.integrations.lightning  # noqa: F401  (registers the names)
    trainer = lightning.Trainer(strategy="zerotrain_stage_3", accelerator="cpu", devices=2)

or pass ``ZeroTrainStrategy(stage=..., config={...})``. Needs the ``lightning`` package
(``pip install zerotrain[lightning]``); see docs/integrations.md.
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zerotrain.integrations.lightning needs PyTorch Lightning: "
        "pip install 'zerotrain[lightning]'"
    ) from exc

from zerotrain.integrations.lightning.precision import ZeroTrainPrecision
from zerotrain.integrations.lightning.strategy import ZeroTrainStrategy

__all__ = ["ZeroTrainPrecision", "ZeroTrainStrategy", "register"]


def register() -> None:
    """Register the strategy names with Lightning (done on import; repeating is harmless)."""
    ZeroTrainStrategy.register_strategies(StrategyRegistry)


register()
