import itertools
import random

from dp_shards import data_cfg, text_shards

from mmtrain.data_pipelines.config import SourceConfig
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.mixing import Mixer
from mmtrain.data_pipelines.rng import CounterRng
from mmtrain.data_pipelines.tokenizer import ByteTokenizer


def _draws(mixer: Mixer, n: int) -> list[int]:
    out = []
    for _ in range(n):
        i = mixer.choose()
        mixer.took(i)
        out.append(i)
    return out


def test_mixture_is_deterministic_per_seed_and_follows_weights():
    seed = random.randrange(1 << 30)
    weights = [3.0, 1.0, 0.5]
    a = _draws(Mixer(weights, CounterRng(seed, "mix")), 6000)
    assert a == _draws(Mixer(weights, CounterRng(seed, "mix")), 6000)
    assert a != _draws(Mixer(weights, CounterRng(seed + 1, "mix")), 6000)
    for i, w in enumerate(weights):
        assert abs(a.count(i) / 6000 - w / 4.5) < 0.03


def test_exhausted_source_leaves_and_state_round_trips():
    m = Mixer([1.0, 1.0], CounterRng(0))
    _draws(m, 10)
    m.exhausted(0)
    assert set(_draws(m, 50)) == {1}
    m2 = Mixer([1.0, 1.0], CounterRng(0))
    m2.load_state_dict(m.state_dict())
    assert _draws(m2, 20) == _draws(m, 20) and m2.ratios() == m.ratios()
    m.exhausted(1)
    assert m.choose() is None


def test_loader_reports_realised_ratios(tmp_path):
    a = text_shards(tmp_path, 2, 20, prefix="a")
    b = text_shards(tmp_path, 2, 20, prefix="b")
    cfg = data_cfg(train=a, seq_len=32, batch_size=4)
    cfg.train = [SourceConfig("a", a, weight=3.0), SourceConfig("b", b, weight=1.0)]
    tok = ByteTokenizer()
    runs = []
    for _ in range(2):
        loader = build_loader(cfg, tok, "train")
        runs.append([x.tokens_BS for x in itertools.islice(loader, 60)])
        mix = loader.stats()["mixture"]
        assert mix["a"]["target"] == 0.75 and abs(mix["a"]["realised"] - 0.75) < 0.08
    assert all((x == y).all() for x, y in zip(*runs))
