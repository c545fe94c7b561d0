"""A pipeline's stages built alone from the meta device hold exactly one process's initial values,
and its evaluation replica (host memory, streamed to the device a module at a time) gives the
whole model's forward and captions (mmtrain/parallel/pipeline_replica.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_pipeline import _inputs, _model

from mmtrain.models.inference import SamplingConfig, generate_tokens
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.models.testing import IMAGE, pack, random_doc
from mmtrain.parallel.pipeline import build_stage_models, materialize
from mmtrain.parallel.pipeline_replica import Streamed, block_modules


@pytest.mark.parametrize("schedule, pp", [("1F1B", 2), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2),
                                          ("1F1B", 4)])
def test_stages_built_from_meta_hold_one_processs_initial_values(schedule, pp):
    """Each block's values come from its own seed, so a stage materialised alone equals the same
    blocks of the model one process builds from the same global seed (the trainer's parity rests on it)."""
    cfg = _model(8).cfg
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    whole = MultimodalModel(cfg)
    after_whole = torch.rand(3)
    torch.manual_seed(seed)
    with torch.device("meta"):
        skeleton = MultimodalModel(cfg)
    assert torch.equal(torch.rand(3), after_whole)  # one draw from the global RNG either way
    want = whole.state_dict()
    seen = set()
    for rank in range(pp):
        for part in build_stage_models(copy.deepcopy(skeleton), schedule, rank, pp, 96):
            got = materialize(part, torch.device("cpu")).state_dict()
            for k, v in got.items():
                assert torch.equal(v, want[k]), k
            seen |= set(got)
    assert seen == set(want)  # the stages together hold every tensor


def test_a_blocks_values_do_not_depend_on_the_other_blocks():
    """The seeded rule: a layer's values are the same in a 4-layer and an 8-layer model with one seed
    (no block draws from a stream another block advanced)."""
    a, b = _model(4), _model(8)  # both seed the global RNG with 0
    for name in ("vision", "decoder.embed", "decoder.layers.2"):
        sa, sb = block_modules(a)[name].state_dict(), block_modules(b)[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa if "wo" not in k and "w_out" not in k), name


def _streamed(model: MultimodalModel) -> tuple[MultimodalModel, Streamed]:
    replica = copy.deepcopy(model)
    streamed = Streamed(replica, torch.device("cpu"))
    streamed.capture()
    return replica, streamed


def test_the_streamed_replica_gives_the_models_forward_and_holds_no_weight_outside_one():
    model = _model(4).eval()
    replica, streamed = _streamed(model)
    assert all(p.is_meta for p in replica.parameters())  # off the device between forwards
    inputs = _inputs(model)
    want, got = model(**inputs), replica(**inputs)
    assert torch.equal(want.logits_BSV, got.logits_BSV)
    for name in want.aux_losses:
        assert torch.equal(want.aux_losses[name], got.aux_losses[name]), name
    assert all(p.is_meta for p in replica.parameters())
    streamed.release()
    with pytest.raises(KeyError):  # released: a forward has no weights to place
        replica(**inputs)


def test_the_streamed_replica_captions_as_the_model_does():
    """generate's prefill and decode steps call the layers' parts (project, output, feed_forward),
    the cache is allocated on the inputs' device: every weight read goes through a module's call."""
    model = _model(4).eval()
    replica, _ = _streamed(model)
    P = model.cfg.vision.patch_dim
    prompt = pack([[random_doc(64, P, 6, ((IMAGE, (1, 4, 4)),))]], 48, P, merge=model.cfg.vision.merge)
    cfg = SamplingConfig(max_new_tokens=8)
    want = generate_tokens(model, prompt, cfg, eos_id=None).tokens
    assert generate_tokens(replica, prompt, cfg, eos_id=None).tokens == want


def test_a_replica_larger_than_the_hosts_free_memory_is_refused_in_one_line(monkeypatch):
    """m3 (423B parameters) would need 1.7 TB of host memory on each pipeline's first rank."""
    from mmtrain.errors import UserError
    from mmtrain.parallel import pipeline_replica

    monkeypatch.setattr(pipeline_replica, "available_host_bytes", lambda: 1024)
    replica = pipeline_replica.PipelineReplica(_model(4).cfg, 0, holder=True, device=torch.device("cpu"))
    with pytest.raises(UserError) as e:
        replica._build()
    assert "train.eval_every: 0" in str(e.value) and "\n" not in str(e.value)
