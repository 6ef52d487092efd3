"""DeepSpeed's ``deepspeed.pipe`` names, so ``from zerotrain.pipe import PipelineModule,
LayerSpec`` replaces ``from deepspeed.pipe import ...``."""

from zerotrain.parallel.pipeline.module import PipelineModule
from zerotrain.parallel.pipeline.specs import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
