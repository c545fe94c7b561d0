"""mmtrain: joint text + image + video pretraining. The one thing done at import: refuse a torch older
than the code needs, in one line, before a missing private API fails somewhere deep in a run."""

from __future__ import annotations

import re
from importlib import metadata

# The oldest torch with everything used: DeviceMesh._unflatten (mmtrain/parallel/dims.py) shipped in
# 2.9 (pytorch#159482); the rest is older (fully_shard from torch.distributed.fsdp and flex_attention's
# BlockMask.from_kv_blocks 2.6, torch.library.custom_op 2.4, DCP async_save and get_model_state_dict
# 2.3, aten._scaled_dot_product_flash_attention_for_cpu 2.3). Newer-only APIs are probed where used
# (torch._grouped_mm, DDP's forward_sync_buffers).
TORCH_FLOOR = (2, 9)


def check_torch(version: str | None) -> None:
    """Raise ImportError (one line) when `version` is below TORCH_FLOOR; None (no metadata) passes."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m and (int(m[1]), int(m[2])) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"mmtrain needs torch >= {floor} (DeviceMesh._unflatten), found torch {version}: "
                          f"pip install 'torch>={floor}'")


def _installed_torch() -> str | None:
    try:  # the metadata, not `import torch`: the check stays cheap where torch is not needed yet
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


check_torch(_installed_torch())
