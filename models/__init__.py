"""mmtrain's model: a from-scratch ViT feeding a sparse-attention MoE decoder.

Architecture only (no parallelism, optimizer or losses beyond the MoE router terms); the trainer
applies FSDP2 / activation checkpointing / compile per block from outside (`vision.blocks`,
`decoder.layers`). `models` never imports `mmtrain` or `data_pipelines`.
"""

if __name__ != "mmtrain.models":  # the checkout's folder under its own name: a second copy
    raise ImportError(f"import mmtrain.models, not {__name__}: the folder is installed under that "
                      "name (pip install -e . or make install)")

from .attention import AttentionConfig
from .counting import ParamCount
from .decoder import DecoderConfig
from .moe import MoEConfig
from .multimodal import ModelConfig, ModelOutput, MultimodalModel
from .vision import VisionConfig

__all__ = ["AttentionConfig", "DecoderConfig", "ModelConfig", "ModelOutput", "MoEConfig", "MultimodalModel",
           "ParamCount", "VisionConfig"]
