"""The Hugging Face classes of an exported mmtrain model, self-contained (no mmtrain import):
`mmtrain export --hf` copies `REMOTE_FILES` next to the weights and names them in config.json's
`auto_map`, so transformers loads the folder with `trust_remote_code=True` where mmtrain is not
installed. `convert.py` (not copied) maps mmtrain state dicts to these classes' names and back.
This package's `__init__` imports nothing: the export runs without transformers.
"""

REMOTE_FILES = (
    "configuration_mmtrain.py",
    "modeling_mmtrain.py",
    "attention_mmtrain.py",
    "cache_mmtrain.py",
    "layout_mmtrain.py",
    "moe_mmtrain.py",
    "ops_mmtrain.py",
    "vision_mmtrain.py",
    "processing_mmtrain.py",
    "image_processing_mmtrain.py",
)
