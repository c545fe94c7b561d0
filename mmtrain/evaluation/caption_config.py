"""The captioning eval's config (config section `captions`; the eval is mmtrain/evaluation/captioning.py).

Its own module because the run config composes it while the eval itself loads and decodes with
mmtrain/inference/loading.py and mmtrain/inference/generate.py, which read the run config: imports
point one way."""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.checks import check


@dataclass
class CaptionEvalConfig:
    images: int = 8  # val images captioned at every evaluation (0 and videos 0: off)
    videos: int = 4
    max_new_tokens: int = 40
    scan: int = 400  # val samples read at most (once) to find them
    examples: int = 4  # captions kept in the eval record and the log

    def __post_init__(self) -> None:
        check(self, "images", "videos", "scan", "examples", ge=0)
        check(self, "max_new_tokens", ge=1)
