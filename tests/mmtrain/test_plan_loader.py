"""The plan's loader line: cores a GPU = core-seconds a batch x batches a step / step time."""

from types import SimpleNamespace

import webdataset as wds

from mmtrain.data_pipelines.config import DataConfig, SourceConfig
from mmtrain.plan import loader as L


def _run_config(shards: list[str], accum: int) -> SimpleNamespace:
    data = DataConfig(train=[SourceConfig("t", shards)], seq_len=64, batch_size=2, num_workers=2,
                      shuffle_buffer=4)
    return SimpleNamespace(data=data, train=SimpleNamespace(grad_accum=accum))


def test_cores_follow_the_measured_rate_the_step_time_and_accumulation(tmp_path, monkeypatch):
    with wds.TarWriter(str(tmp_path / "t.tar")) as w:
        for i in range(40):
            w.write({"__key__": f"k{i:03d}", "txt": f"document {i} " * 20})
    cfg = _run_config([str(tmp_path / "t.tar")], accum=3)
    assert L.core_seconds_per_batch(cfg.data, batches=2) > 0  # the real loader, read here
    monkeypatch.setattr(L, "core_seconds_per_batch", lambda data, batches: 0.5)  # the arithmetic alone
    need = L.loader_need(cfg, step_s=0.25)
    assert need["cores"] == 0.5 * 3 / 0.25
    assert "the loader needs ~6.0 cores a GPU at this step time" in L.text(need)[0]


def test_without_local_shards_the_need_is_unknown_and_says_why(tmp_path):
    need = L.loader_need(_run_config([str(tmp_path / "gone-*.tar")], accum=1), step_s=0.1)
    assert "unknown" in need and "gone-*.tar" in L.text(need)[0]
