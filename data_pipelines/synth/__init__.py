"""The built-in "shapes world" corpus: images, clips, interleaved and text documents, no downloads.

    from mmtrain.data_pipelines.synth import SynthConfig, write_corpus
    manifest = write_corpus("data/shapes", SynthConfig(seed=0))

CLI: `mmtrain data synth --out DIR` (see `data_pipelines.synth.cli`).
"""

from mmtrain.data_pipelines.synth.config import KINDS, SPLITS, SynthConfig

__all__ = ["KINDS", "SPLITS", "SynthConfig", "write_corpus"]


def __getattr__(name: str):
    # Lazy: the writer pulls in webdataset (and with it torch); the sample-making worker
    # processes import this package and need neither.
    if name == "write_corpus":
        from mmtrain.data_pipelines.synth.writer import write_corpus

        return write_corpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
