"""Caption eval under FSDP on 2 gloo ranks: the same captions and scores as one process holding the
whole model, from exactly one replica (rank 0's), built on the meta device (no random init)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .dist_runs import launch, write_config

WORKER = Path(__file__).with_name("caption_worker.py")
CAPTIONS = ["captions.images=2", "captions.videos=1", "captions.examples=3", "captions.max_new_tokens=6",
            "dist.timeout_s=60", "train.threads=1"]


@pytest.mark.distributed
def test_sharded_caption_eval_gathers_one_replica_and_matches_one_process(make_raw, tmp_path):
    one = write_config(make_raw, tmp_path / "one", CAPTIONS)
    launch([str(WORKER), str(one), str(tmp_path / "one")])
    two = write_config(make_raw, tmp_path / "two", [*CAPTIONS, "dist.strategy=fsdp"])
    launch([str(WORKER), str(two), str(tmp_path / "two")], nproc=2)
    single = json.loads((tmp_path / "one.rank0.json").read_text())
    ranks = [json.loads((tmp_path / f"two.rank{r}.json").read_text()) for r in (0, 1)]
    assert single["built"] == []  # an unsharded model captions from itself
    assert [r["built"] for r in ranks] == [["meta"], []]  # one replica, rank 0's, no random init
    want = single["result"]
    assert len(want["examples"]) == 3 and want["words"]
    assert ranks[0]["result"] == want and ranks[1]["result"] == want  # rank 1 gets rank 0's result


def test_replica_from_state_holds_every_parameter_and_buffer(make_config, tmp_path):
    """Built on the meta device, it has no values of its own: every one must come from the state."""
    import torch

    from mmtrain.inference.loading import gather_full_state, replica_from_state
    from mmtrain.models.multimodal import MultimodalModel

    cfg = make_config(tmp_path / "run").model
    cfg.decoder.vocab_size = 300
    model = MultimodalModel(cfg)
    with torch.no_grad():  # buffers away from what an empty allocation or an init would hold
        for _, b in model.named_buffers():
            b.copy_(torch.randint(1, 9, b.shape).to(b.dtype))
    replica = replica_from_state(cfg, gather_full_state(model, keep=True), torch.device("cpu"))
    want = dict([*model.named_parameters(), *model.named_buffers()])
    got = dict([*replica.named_parameters(), *replica.named_buffers()])
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
