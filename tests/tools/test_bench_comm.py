"""tools/bench/bench_comm.py and bench_comm_cp.py: the collectives counted on 2 gloo ranks equal
the formula on the tiny model, for FSDP-gathered experts and for expert parallelism; the CP
fetch count equals the bytes the context-parallel sparse layer sends, and obeys what the block
rule implies on small rows."""

from __future__ import annotations

import pytest

from mmtrain.models.attention.config import AttentionConfig
from tools.bench import bench_comm, bench_comm_cp


@pytest.mark.distributed
def test_counted_bytes_equal_the_formula_at_fsdp2_and_ep2(warm_subprocess):
    rows = [bench_comm.compare(name, *bench_comm.MEASURED_MESHES[name][:2],
                               bench_comm.measure(name, *bench_comm.MEASURED_MESHES[name][:2], timeout=180))
            for name in ("FSDP(2)", "EP(2)")]
    for r in rows:
        for side in bench_comm.SIDES:
            got, want = r[side]
            assert got == pytest.approx(want, rel=1e-9, abs=1e-6), (r["mesh"], side)
        assert r["a2a_counted"] == pytest.approx(r["a2a"][0], rel=1e-9, abs=1e-6)  # Traffic == the calls
    fsdp, ep = rows
    assert fsdp["all_gather"][0] > 0 and fsdp["a2a"][0] == 0
    assert ep["a2a"][0] > 0  # rows travel; and the experts are no longer gathered:
    assert ep["all_gather"][0] < fsdp["all_gather"][0] and ep["f"]["ag_expert"] == 0


def test_formula_scales_as_stated():
    cfg = bench_comm.tiny_model_cfg().model
    one = bench_comm.formula(cfg, {"world": 4, "ep": 2}, tokens=1000)
    two = bench_comm.formula(cfg, {"world": 4, "ep": 2}, tokens=2000)
    assert two["a2a"] == pytest.approx(2 * one["a2a"]) and two["ag_expert"] == one["ag_expert"]
    hsdp = bench_comm.formula(cfg, {"world": 4, "dp_replicate": 2}, tokens=1000)
    assert hsdp["ar_other"] > 0 and bench_comm.formula(cfg, {"world": 4}, tokens=1000)["ar_other"] == 0


def test_cp_fetch_follows_the_documents_and_never_exceeds_the_all_gather():
    cfg = AttentionConfig(block_size=8, window=16, top_k=2, visual_always=True)
    S = 1024
    lone = bench_comm_cp.cp_fetch(S, [2, 4], cfg, kv_heads=2, real_head_dim=16, head_dim=8)
    for v in lone["cp"].values():
        assert 0 < v["fetch_max"] <= v["gather"]
    # documents of exactly one chunk each: no query keeps a block of another chunk
    aligned = bench_comm_cp.cp_fetch(S, [4], cfg, kv_heads=2, real_head_dim=16, head_dim=8, doc_len=S // 4)
    assert aligned["cp"][4]["fetch_max"] == 0
    # one query for every token: every query block ranks alike, so a chunk needs less than at random
    shared = bench_comm_cp.cp_fetch(S, [4], cfg, kv_heads=2, real_head_dim=16, head_dim=8, queries="shared")
    assert shared["cp"][4]["fetch_mean"] < lone["cp"][4]["fetch_mean"]


@pytest.mark.distributed
def test_cp_fetch_equals_what_the_context_parallel_layer_sends(warm_subprocess):
    """The sparse layer of models/attention/context.py on 2 gloo ranks, on the same row (an image
    across the chunk boundary, documents that straddle it): each rank's counted `cp_kv_fetch`
    bytes are the ones cp_fetch computes."""
    args = dict(S=1024, doc_len=300, image_every=512, image_tokens=32, kv_heads=2, head_dim=8, seed=5,
                queries="random", attn=dict(block_size=16, window=32, top_k=3, visual_always=True))
    counted, computed = bench_comm_cp.cp_check(args, 2, timeout=120)
    assert counted == computed and sum(counted) > 0
