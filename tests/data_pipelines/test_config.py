import pytest

from mmtrain.data_pipelines.config import DataConfig, MediaConfig, SourceConfig


def test_defaults_construct():
    cfg = DataConfig()
    assert cfg.train == [] and cfg.media.factor == cfg.media.patch_size * cfg.media.merge


@pytest.mark.parametrize(("make", "field"), [
    (lambda: DataConfig(seq_len=4), "seq_len"),
    (lambda: DataConfig(batch_size=0), "batch_size"),
    (lambda: DataConfig(num_workers=-1), "num_workers"),
    (lambda: DataConfig(max_failure_rate=1.5), "max_failure_rate"),
    (lambda: DataConfig(train=[SourceConfig("a", ["x"]), SourceConfig("a", ["y"])]), "train"),
    (lambda: SourceConfig("a", ["x"], weight=0.0), "weight"),
    (lambda: SourceConfig("", ["x"]), "name"),
    (lambda: MediaConfig(min_pixels=10), "min_pixels"),
    (lambda: MediaConfig(max_pixels=16 * 16, min_pixels=32 * 32), "max_pixels"),
    (lambda: MediaConfig(video_max_frames=7), "video_max_frames"),
    (lambda: MediaConfig(video_min_frames=6, video_max_frames=4), "video_max_frames"),
    (lambda: MediaConfig(std=(0.5, 0.0, 0.5)), "std"),
    (lambda: MediaConfig(video_fps=0.0), "video_fps"),
])
def test_bad_values_name_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()
