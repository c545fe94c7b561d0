"""`mmtrain plan` (mmtrain/plan/): the planned peak equals the peak of the same step on real tensors
(1 and 2 gloo ranks); its collective bytes equal bench_comm's formula (itself equal to the bytes
counted on gloo, tests/tools/test_bench_comm.py); its FLOPs equal a count by hand; its verdict is
the exit code; bad meshes and GPU names are one-line errors naming the key; the fast memory
bookkeeping (tracker.py) gives the reference's plan; the vision encoder's cost per balance mode."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mmtrain.cli import main
from mmtrain.config import load_config
from mmtrain.models import testing
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.plan import gpus
from mmtrain.plan.batch import _with_targets
from mmtrain.plan.cli import make_plan
from mmtrain.plan.flops import component_flops
from mmtrain.run_config import RunConfig
from tools.bench import bench_comm, bench_plan

TINY = str(bench_plan.REPO / "configs" / "tiny.yaml")


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2])
def test_planned_peak_equals_the_measured_peak(ranks, warm_subprocess):
    planned = bench_plan.planned(f"tiny:{ranks}:rows=2")
    measured = bench_plan.measured(f"tiny:{ranks}:rows=2", timeout=300)
    assert planned["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.02)
    for category, nbytes in measured["by_category"].items():
        assert planned["by_category"][category] == pytest.approx(nbytes, rel=0.05, abs=2**20), category
    by_module = {m["module"]: m["bytes"] for m in planned["top_modules"]}  # the layers' own peaks
    assert by_module == pytest.approx({m["module"]: m["bytes"] for m in measured["top_modules"]}, rel=0.02)


@pytest.mark.parametrize("mesh", [{}, {"ep": 2}], ids=["FSDP(2)", "EP(2)"])
def test_planned_bytes_equal_bench_comms_formula(mesh):
    sets = ["model.decoder.vocab_size=512", "model.visual_head=false", "loss.visual_next.weight=0",
            "data.batch_size=2", *(f"dist.{k}={v}" for k, v in mesh.items())]
    plan = make_plan(TINY, 2, "h100", sets, visual_frac=0.0)
    got: dict[str, float] = {}
    for row in plan["comm"]:
        if row["kind"] != "all_reduce":  # (the loop's own sums and the MoE load: not in the formula)
            got[row["kind"]] = got.get(row["kind"], 0.0) + row["bytes"]
    f = bench_comm.formula(bench_comm.tiny_model_cfg().model, {"world": 2, **mesh}, tokens=2 * 256,
                           param_bytes=4, grad_bytes=4, act_bytes=4)
    assert got["all_gather"] == pytest.approx(f["ag_expert"] + f["ag_other"], rel=1e-9)
    assert got["reduce_scatter"] == pytest.approx(f["rs_expert"] + f["rs_other"], rel=1e-9)
    assert got.get("all_to_all", 0.0) == pytest.approx(f["a2a"], rel=1e-9)
    assert (f["a2a"] > 0) == bool(mesh)


def test_flops_equal_a_count_by_hand():
    """tiny: D 128, 4 heads of 32 (2 kv), layers F S F S, layer 0 dense (SwiGLU 384), 1-3 MoE (8
    experts of 128, top 2, one shared of 128); vision 96 wide, 2 blocks, MLP 384, patches of 384
    values, projector 384 -> 384 -> 128; sparse cap: window 8 + (own + sink + top 2) x 4 = 24."""
    cfg = load_config(RunConfig, TINY, ["model.decoder.vocab_size=512"])
    with torch.device("meta"):
        model = MultimodalModel(cfg.model)
    image = testing.Medium(1, (1, 8, 8), torch.zeros(64, 384))  # 16 visual tokens
    docs = [[image, torch.full((16,), 5)], [torch.full((32,), 5)]]  # two documents of 32 tokens
    batch = _with_targets(testing.pack([docs], 64, 384), n_img=1, n_vis=16)
    got = component_flops(model, batch)
    T, attn_proj, per_pair = 64, 256 * 128 + 128 * 128, 12 * 4 * 32
    full_pairs, sparse_pairs = 2 * 32 * 33 / 2, 2 * (24 * 25 / 2 + 8 * 24)
    tower = 96 * 384 + 2 * (288 * 96 + 96 * 96 + 2 * 384 * 96)
    want = {
        "full attention": 2 * (6 * attn_proj * T + per_pair * full_pairs),
        "sparse attention": 2 * (6 * attn_proj * T + per_pair * sparse_pairs),
        "dense ffn": 6 * (768 * 128 + 128 * 384) * T,
        "moe experts": 3 * 6 * 2 * (128 * 256 + 128 * 128) * T,
        "shared experts": 3 * 6 * (256 * 128 + 128 * 128) * T,
        "router": 3 * 6 * 8 * 128 * T,
        "lm head": 6 * 512 * 128 * T,
        "vit": 6 * tower * 64 + 12 * 96 * 2 * 64 ** 2 + 6 * (384 * 384 + 128 * 384) * 16,
        "visual head": 6 * 1536 * 128 * 16,
    }
    assert got == pytest.approx(want, rel=1e-12)
    again = component_flops(model, batch, accum=2, keep_rate=0.5, recompute=True)
    assert again["sparse attention"] == pytest.approx(2 * 2 * (6 * attn_proj * T + per_pair * full_pairs / 2))
    assert again["recompute"] == pytest.approx(sum(v for k, v in again.items()
                                                   if k not in ("recompute", "lm head", "visual head")) / 3)


def test_json_and_the_exit_code_say_whether_it_fits(monkeypatch, capsys):
    monkeypatch.setitem(gpus.GPUS, "toy", gpus.GPU("toy", gpus.MARGIN_GIB + 1.0, 100.0, 1.0, 100.0, 10.0))
    code = main(["plan", TINY, "--gpus", "2", "--gpu", "toy", "--json"])
    plan = json.loads(capsys.readouterr().out)
    peak = plan["memory"]["peak_bytes"]
    assert peak > 2**30 and not plan["memory"]["fits"] and code == 3  # tiny at vocab 32k: ~1.5 GiB
    assert peak == pytest.approx(sum(plan["memory"]["by_category"].values()))
    fsdp = {r["kind"] for r in plan["comm"] if r["dim"] == "fsdp"}  # 2 ranks: one group
    assert fsdp == {"all_gather", "reduce_scatter", "all_reduce"}
    assert main(["plan", TINY, "--gpus", "2", "--gpu", "h100"]) == 0
    vision = plan["vision"]  # the encoder's cost per rank, with and without vision.balance
    assert vision["balance"] == "none" and set(vision["modes"]) == {"none", "dp"}
    assert "vision encoder cost per rank" in capsys.readouterr().out


def test_the_fast_tracker_gives_the_reference_trackers_plan():
    """tracker.py's bookkeeping (the default) against torch's FSDPMemTracker (`--exact`): the same
    plan to the byte, per category and per module, at FSDP + EP (expert modules tracked too)."""
    sets = ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.ep=2"]
    fast, exact = (make_plan(TINY, 2, "h100", sets, exact=e) for e in (False, True))
    assert fast["memory"] == exact["memory"] and fast["memory"]["top_modules"]


@pytest.mark.budget(30)  # 7 s measured
def test_one_layer_per_kind_scaled_is_the_full_trace():
    """layers.py (the default for large configs): the reduced models' traces scaled to 6 decoder
    layers (three kinds, one of them 3 times) and 3 vision blocks give the full trace's plan: the
    peak per category within 1% (measured: to the byte), collectives and FLOPs equal."""
    sets = ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.ep=2", "model.decoder.n_layers=6",
            "model.vision.depth=3"]
    full, fast = (make_plan(TINY, 2, "h100", sets, scaled=s) for s in (False, True))
    for cat, nbytes in full["memory"]["by_category"].items():
        assert fast["memory"]["by_category"][cat] == pytest.approx(nbytes, rel=0.01, abs=1024), cat
    assert fast["memory"]["peak_bytes"] == pytest.approx(full["memory"]["peak_bytes"], rel=0.01)
    assert [(c["dim"], c["kind"], c["calls"]) for c in fast["comm"]] == \
        [(c["dim"], c["kind"], c["calls"]) for c in full["comm"]]
    assert [c["bytes"] for c in fast["comm"]] == pytest.approx([c["bytes"] for c in full["comm"]], rel=1e-12)
    assert fast["flops"]["by_component"] == pytest.approx(full["flops"]["by_component"], rel=1e-12)


def test_vision_balance_is_traced():
    """vision.balance dp_cp at cp 2 (4 ranks): the plan runs the trainer's balancer, so each medium
    is encoded once in the world instead of on both cp ranks: this rank's ViT FLOPs halve (the
    plan's rows are the same on every rank: LPT splits them evenly), its peak drops, and the
    exchanges appear as `vision` traffic; without balancing there is none."""
    sets = ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.cp=2"]
    off, on = (make_plan(TINY, 4, "h100", [*sets, f"vision.balance={b}"]) for b in ("none", "dp_cp"))
    assert on["flops"]["by_component"]["vit"] == off["flops"]["by_component"]["vit"] / 2
    assert on["memory"]["peak_bytes"] < off["memory"]["peak_bytes"]
    vision = {c["kind"]: c["bytes"] for c in on["comm"] if c["dim"] == "vision"}
    assert vision["all_to_all"] > 0 and not any(c["dim"] == "vision" for c in off["comm"])


def test_tp_traffic_equals_the_tp_layers_own_count():
    """TP(2) x FSDP(2): the plan applies the trainer's apply_tp; the collectives it sees on the tp
    group are those tensor_parallel.py counts for itself (its Traffic, the bytes `train` logs):
    the activations' all-gathers (no rotary tables: each rank computes its group's) and
    reduce-scatters (no all-reduce: half an all-reduce's bytes), to the byte."""
    from mmtrain.plan.trace import PlanOptions, trace

    cfg = load_config(RunConfig, TINY, ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.tp=2"])
    t = trace(cfg, PlanOptions(gpus=4))
    tp = {kind: nbytes for (dim, kind), (_, nbytes) in t.comm.items() if dim == "tp"}
    own = t.own_counts
    assert tp["all_gather"] == own["tp_all_gather"] > 0 and "tp_rotary_all_gather" not in own
    assert tp["reduce_scatter"] == own["tp_reduce_scatter"] > 0 and "all_reduce" not in tp
    assert t.tokens == cfg.data.batch_size * cfg.data.seq_len // 2 and t.mesh["tp"] == 2


def test_pipeline_stages_cover_the_layers_once():
    """PP(2) x FSDP(2), 1F1B, 2 micro-batches: the two stages' traced decoder FLOPs add up to the
    unpipelined plan's on the same 2 data ranks, x 2 micro-batches (the trainer's split holds every
    layer once; the unpipelined plan traces one micro-batch: FSDPMemTracker takes one), each
    stage sends one residual stream (fp32 B x S x D + the (2,) aux losses) a micro-batch (a hand
    count), and the bubble is (pp - 1) / (m + pp - 1) = 1/3."""
    sets = ["model.decoder.vocab_size=512", "data.batch_size=2"]
    piped = [*sets, "dist.pp=2", "train.grad_accum=2"]
    first, last = (make_plan(TINY, 4, "h100", piped, rank=r) for r in (0, 2))
    flat = make_plan(TINY, 2, "h100", sets)
    layers = ("full attention", "sparse attention", "dense ffn", "moe experts", "shared experts", "router")
    for k in layers:
        assert first["flops"]["by_component"][k] + last["flops"]["by_component"][k] == \
            pytest.approx(2 * flat["flops"]["by_component"][k], rel=1e-9), k
    cfg = load_config(RunConfig, TINY, sets)
    h = 2 * cfg.data.batch_size * cfg.data.seq_len * cfg.model.decoder.dim * 4 + 2 * 2 * 4  # 2 micro-batches
    for plan in (first, last):
        pp = [c for c in plan["comm"] if c["dim"] == "pp"]
        assert [(c["calls"], c["bytes"]) for c in pp] == [(2, h)]
        assert plan["pipeline"]["bubble"] == pytest.approx(1 / 3) and plan["mesh"]["pp"] == 2


def test_pipelined_tp_collectives_count_every_micro_batch():
    """TP(2) x PP(2): a split layer's all-gathers and reduce-scatters run in every micro-batch's
    forward and backward, so 4 micro-batches move 4x the tp bytes of 1 (they were counted once for
    the reduce-scatters: the m3 row's tp traffic 16x low); FSDP's gradient reduce-scatter stays once."""
    sets = ["model.decoder.vocab_size=512", "data.batch_size=2", "model.decoder.n_kv_heads=2", "dist.tp=2",
            "dist.pp=2"]
    # 8 ranks: tp's group (2) is not FSDP's (4: fsdp includes tp), so their reduce-scatters part
    one, four = (make_plan(TINY, 8, "h100", [*sets, f"train.grad_accum={m}"]) for m in (1, 4))

    def by(plan, dim, kind):
        return next(c["bytes"] for c in plan["comm"] if (c["dim"], c["kind"]) == (dim, kind))

    for kind in ("all_gather", "reduce_scatter"):
        assert by(one, "tp", kind) > 0
        assert by(four, "tp", kind) == pytest.approx(4 * by(one, "tp", kind), rel=1e-9), kind
    fsdp_rs = [c for c in four["comm"] if c["kind"] == "reduce_scatter" and c["dim"] != "tp"]
    assert fsdp_rs and all(c["bytes"] == by(one, c["dim"], "reduce_scatter") for c in fsdp_rs)


def test_vision_stage_plan_places_the_stages_as_the_trainer():
    """dist.pp_vision_stage at PP(2) x 1F1B: the plan's split is the trainer's (stage 0 no layer, stage
    1 every layer); stage 0's rank counts the encoder's FLOPs and no decoder layer's (the one layer it
    traces for memory included), stage 1's every decoder layer's and no encoder's."""
    from mmtrain.parallel.pipeline import build_stage_models

    piped = ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.pp=2", "train.grad_accum=2",
             "dist.pp_vision_stage=true"]
    first, last = (make_plan(TINY, 2, "h100", piped, rank=r) for r in (0, 1))
    cfg = load_config(RunConfig, TINY, piped)
    with torch.device("meta"):
        model = MultimodalModel(cfg.model)
    for rank, plan in ((0, first), (1, last)):
        stages = build_stage_models(copy.deepcopy(model), "1F1B", rank, 2, cfg.data.seq_len, True)
        assert plan["pipeline"]["layers"] == stages[0].layer_ids
    assert last["pipeline"]["layers"] == list(range(cfg.model.decoder.n_layers))
    assert first["pipeline"]["layers"] == [] and "no decoder layer" in "\n".join(report_lines(first))
    for k in ("full attention", "sparse attention", "dense ffn", "moe experts", "shared experts", "router"):
        assert first["flops"]["by_component"][k] == 0
        assert last["flops"]["by_component"][k] > 0, k
    assert first["flops"]["by_component"]["vit"] > 0 == last["flops"]["by_component"]["vit"]


def report_lines(plan: dict) -> list[str]:
    from mmtrain.plan.report import text

    return text(plan).splitlines()


@pytest.mark.parametrize("cp, dp", [(1, 4), (2, 4), (4, 2)])
def test_vision_cost_per_rank_with_and_without_balance(cp, dp):
    """The planned rows are the same on every rank: `dp` changes nothing; `dp_cp` encodes each
    medium once in the world, so its mean rank does 1/cp of the work every cp rank does without;
    no mode's busiest rank does more than without balance."""
    from mmtrain.parallel.vision_balance import VisionBalanceConfig
    from mmtrain.plan.vision import vision_costs

    media = [256, 1024, 64, 64, 576]
    got = vision_costs(VisionBalanceConfig(balance="dp"), media, {"dp_replicate": dp, "cp": cp})["modes"]
    none = got["none"]["max"]
    assert none == pytest.approx(sum(1.6e-4 * n * n + n + 64 for n in media))
    assert got["dp"]["max"] == pytest.approx(none) and got["dp"]["mean"] == pytest.approx(none)
    assert ("dp_cp" in got) == (cp > 1)
    if cp > 1:
        assert got["dp_cp"]["mean"] == pytest.approx(none / cp)
        assert none / cp <= got["dp_cp"]["max"] < none


@pytest.mark.parametrize("args, key", [(["--gpus", "3", "--set", "dist.dp_replicate=2"], "dist.dp_replicate"),
                                       (["--gpus", "4", "--set", "dist.ep=3"], "dist.ep"),
                                       (["--gpus", "2", "--gpu", "v100"], "--gpu"),
                                       (["--gpus", "4", "--set", "dist.tp=4"],
                                        "model.decoder.n_kv_heads")])  # tiny's 2 KV heads cannot split 4 ways
def test_bad_input_is_one_line_naming_the_key(args, key, capsys):
    assert main(["plan", TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err


@pytest.mark.budget(60)  # 18 s measured (two plans of a 256-wide decoder) on a loaded machine
def test_tp_halves_the_weight_all_gather_over_the_same_ranks():
    """What TP exists to save beside activations: the weights a rank gathers. Over the same 4 ranks,
    TP(2) x FSDP(2) gathers at most 0.55 of FSDP(4)'s weight bytes a step and holds at most 0.55 of
    its gathered-weight peak (a tp rank gathers its Shard of each split weight over the dp ranks);
    measured by the plan, which applies the trainer's apply_tp and FSDP2 on fake tensors. A dense
    decoder whose layers hold most of the weights: the embeddings, LM head, vision encoder (and an
    MoE's routed experts) are not split over tp. Before TP on DTensor: 13.47 MB at TP(1) and TP(2)."""
    sets = ["model.decoder.vocab_size=512", "model.decoder.n_kv_heads=4", "model.decoder.moe=null",
            "model.decoder.dim=256", "model.decoder.ffn_dim=1024", "model.decoder.mrope_sections=[8, 12, 12]"]
    fsdp4, tp2 = (make_plan(TINY, 4, "h100", [*sets, f"dist.tp={tp}"]) for tp in (1, 2))

    def weights(plan):
        return sum(c["bytes"] for c in plan["comm"]
                   if c["kind"] == "all_gather" and c["dim"].startswith("fsdp"))

    def peak(plan):
        return plan["memory"]["by_category"]["gathered weights"]

    assert any(c["dim"] == "tp" and c["kind"] == "all_gather" and c["bytes"] > 0 for c in tp2["comm"])
    assert weights(tp2) <= 0.55 * weights(fsdp4), (weights(tp2), weights(fsdp4))
    assert peak(tp2) <= 0.55 * peak(fsdp4), (peak(tp2), peak(fsdp4))
