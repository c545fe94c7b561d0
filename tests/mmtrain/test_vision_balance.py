"""vision.balance over gloo ranks: the media encoded elsewhere than their rows, the tokens sent
back, and the training the same as one process holding every row (losses, gradient norms, expert
loads), with images, video and interleaved documents. At batch_size=2 over 2 data-parallel ranks,
step 5's second row holds no medium (test_vision_plan.py covers empty ranks exhaustively)."""

from __future__ import annotations

import json

import pytest
from dist_runs import HERE as WORKER
from dist_runs import launch, parity_reference, write_config

from mmtrain.config import apply_override, from_dict
from mmtrain.errors import ConfigError
from mmtrain.run_config import RunConfig

pytestmark = pytest.mark.distributed

STEPS = "5"
TILE = "model.decoder.attention.full_tile=16"  # cp chunks of whole tiles; on every run: one reference
MESHES = {  # (ranks, rows, overrides); the reference: one process, the same rows, balance none
    "fsdp2-dp": (2, 2, ["vision.balance=dp"]),
    "cp2-dp_cp": (2, 2, ["dist.cp=2", "vision.balance=dp_cp"]),
    # media cross cp groups (each sent once, from the group rank i % cp), tokens to both of its ranks
    "fsdp2-cp2-ep2-dp_cp": (4, 2, ["dist.cp=2", "dist.ep=2", "vision.balance=dp_cp"]),
}
SLOW = pytest.mark.slow  # beyond CI's time (~15-60 s each)
MORE_MESHES = {  # MMTRAIN_SLOW_TESTS=1
    "fsdp4-dp": (4, 4, ["vision.balance=dp"]),
    "hsdp2x2-dp": (4, 4, ["dist.dp_replicate=2", "vision.balance=dp"]),
    "ddp4-dp": (4, 4, ["dist.strategy=ddp", "vision.balance=dp"]),
    "fsdp2-ac-accum-dp": (2, 2, ["dist.activation_checkpointing=true", "train.grad_accum=2",
                                 "vision.balance=dp"]),
    # dp under cp: balanced among the ranks of one cp coordinate (its own process groups)
    "fsdp2-cp2-dp": (4, 2, ["dist.cp=2", "vision.balance=dp"]),
}


@pytest.fixture(scope="module")
def reference(raw_for, tmp_path_factory):
    """One process's run on `base` overrides (cached: meshes share it)."""
    cache = {}

    def run(base: list[str]) -> dict:
        key = tuple(base)
        if key not in cache:
            out = tmp_path_factory.mktemp("one")
            config = write_config(raw_for, out / "run", base)
            parity_reference(config, out / "one.json", int(STEPS))
            cache[key] = json.loads((out / "one.json").read_text())
        return cache[key]

    return run


@pytest.mark.parametrize("mesh", [*MESHES, *(pytest.param(m, marks=SLOW) for m in MORE_MESHES)])
def test_balanced_encoding_matches_one_process(raw_for, reference, tmp_path, mesh):
    nproc, rows, overrides = {**MESHES, **MORE_MESHES}[mesh]
    base = [f"data.batch_size={rows}", TILE, *(o for o in overrides if "grad_accum" in o)]
    one = reference(base)
    config = write_config(raw_for, tmp_path / "run", [*base, *overrides])
    launch([str(WORKER), "parity", str(config), str(tmp_path / "bal.json"), STEPS], nproc=nproc)
    bal = json.loads((tmp_path / "bal.json").read_text())
    assert bal["traffic"].get("vision_tokens", 0) > 0  # tokens did travel (under cp: to the other rank)
    if mesh != "cp2-dp_cp":  # step 1's rows hold 3 and 1 media: some leave their rows' ranks
        assert bal["traffic"].get("vision_patches", 0) > 0
    assert bal["tokens"] == one["tokens"]
    assert bal["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert bal["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5, abs=0)
    assert bal["expert_bias"] == one["expert_bias"]  # the same expert loads, step by step


def test_config_names_a_bad_balance(raw_for, tmp_path):
    raw = raw_for(tmp_path / "run")
    apply_override(raw, "vision.balance=dp_cp")
    with pytest.raises(ConfigError, match="dp_cp needs dist.cp > 1"):
        from_dict(RunConfig, raw, source="t")
    apply_override(raw, "vision.balance=ranks")
    with pytest.raises(ConfigError, match="vision.balance: must be one of"):
        from_dict(RunConfig, raw, source="t")
