"""Pipeline parallelism (mmtrain/parallel/pipeline.py, mmtrain/loop/pipeline_step.py).

The stages chained in one process give the model's forward; the split minimises the largest stage
cost; and over gloo, PP ranks under a named schedule give one process's losses, gradient norms and
MoE expert biases on the same rows (rows with images, video and interleaved documents, sparse layers
that select, MoE). PP(2) x 1F1B and TP(2) x PP(2) x 1F1B run in CI; the other schedules, PP(4) and
TP(2) x PP(2) x Interleaved1F1B and CP(2) x PP(2) with MMTRAIN_SLOW_TESTS=1. `dist.pp_vision_stage`
(the encoder's own stage 0): its split and chained stages in CI, the trainer's parity under 1F1B,
Interleaved1F1B, the V schedules and TP(2) x PP(2) slow.
"""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
import yaml
from conftest import tiny_config, tiny_raw
from dist_runs import launch

from mmtrain.config import apply_override
from mmtrain.errors import UserError
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.parallel.pipeline import (
    AUX_NAMES,
    StageModel,
    build_stage_models,
    schedule_class,
    split_layers,
    stage_costs,
    stage_ids,
)

WORKER = "tests/mmtrain/pipeline_worker.py"


def _model(n_layers: int = 4, first_dense: int = 1) -> MultimodalModel:
    from mmtrain.models.attention import AttentionConfig
    from mmtrain.models.decoder import DecoderConfig
    from mmtrain.models.moe import MoEConfig
    from mmtrain.models.vision import VisionConfig

    torch.manual_seed(0)
    att = AttentionConfig(block_size=4, window=4, top_k=1, backend="dense")
    dec = DecoderConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_dim=48,
                        mrope_sections=(2, 3, 3), layer_layout="FS", attention=att,
                        moe=MoEConfig(n_routed=4, top_k=2, expert_dim=16, first_dense_layers=first_dense))
    return MultimodalModel(ModelConfig(VisionConfig(dim=16, depth=1, n_heads=2), dec))


def _inputs(model: MultimodalModel) -> dict:
    torch.manual_seed(1)
    P = model.cfg.vision.patch_dim
    rows = [[random_doc(64, P, 10, ((IMAGE, (1, 4, 4)),)), random_doc(64, P, 6)],
            [random_doc(64, P, 8, ((VIDEO, (2, 4, 4)), (IMAGE, (1, 4, 4))))]]
    return pack(rows, 96, P, merge=model.cfg.vision.merge)


def test_stages_chained_in_one_process_give_the_models_forward():
    model = _model(4)
    inputs = _inputs(model)
    out = model(**inputs)
    ranges = split_layers(stage_costs(model, 96), 3)
    parts = [StageModel(copy.deepcopy(model), s, 3, r) for s, r in enumerate(ranges)]
    x, aux = inputs["tokens_BS"], None
    for part in parts:
        x, aux = part(x, aux, **inputs)
    torch.testing.assert_close(x, out.hidden_BSD, rtol=1e-5, atol=1e-6)
    for i, name in enumerate(AUX_NAMES):
        torch.testing.assert_close(aux[i], out.aux_losses[name], rtol=1e-5, atol=1e-7)
    # every parameter is on exactly one stage, under the full model's name
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters() if not n.startswith("visual_head"))


def test_stage_boundaries_carry_the_gradients_of_one_process():
    """Stages cut apart as a pipeline cuts them (each stage's inputs fresh leaves, its outputs'
    gradients handed back): every parameter gets the full model's gradient, the MoE aux losses'
    included (every layer is MoE, so each boundary carries a non-zero aux sum)."""
    model = _model(4, first_dense=0)
    inputs = _inputs(model)
    ranges = split_layers(stage_costs(model, 96), 3)
    parts = [StageModel(copy.deepcopy(model), s, 3, r) for s, r in enumerate(ranges)]
    out = model(**inputs)
    w_BSD = torch.randn_like(out.hidden_BSD)
    ((out.hidden_BSD * w_BSD).sum() + sum(out.aux_losses.values())).backward()
    acts, x, aux = [], inputs["tokens_BS"], None
    for part in parts:
        x_in = x if part.is_first else x.detach().requires_grad_()
        aux_in = None if part.is_first else aux.detach().requires_grad_()
        x, aux = part(x_in, aux_in, **inputs)
        acts.append((x_in, aux_in, x, aux))
    (acts[-1][2] * w_BSD).sum().add(acts[-1][3].sum()).backward()
    for i in range(len(parts) - 2, -1, -1):
        _, _, h, a = acts[i]
        x_next, aux_next = acts[i + 1][0], acts[i + 1][1]
        assert aux_next.grad is not None, f"no aux-loss gradient came back across boundary {i}"
        outs = [t for t in (h, a) if t.requires_grad]
        grads = [g for t, g in ((h, x_next.grad), (a, aux_next.grad)) if t.requires_grad]
        torch.autograd.backward(outs, grads)
    assert all(a[3].requires_grad for a in acts)  # aux carries a graph across every boundary
    ref = dict(model.named_parameters())
    for part in parts:
        for name, p in part.named_parameters():
            if ref[name].grad is not None:
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_split_minimises_the_largest_stage_and_counts_the_vision_encoder():
    model = _model(8)
    costs = stage_costs(model, 96)
    for n in (2, 3, 4):
        best = max(_stage_loads(costs, split_layers(costs, n)))
        for cuts in itertools.combinations(range(1, 8), n - 1):  # every contiguous split
            bounds = [0, *cuts, 8]
            ranges = [range(a, b) for a, b in zip(bounds, bounds[1:])]
            assert best <= max(_stage_loads(costs, ranges)) + 1e-9
    heavy = {**costs, "vision": 3 * max(costs["layers"])}
    assert len(split_layers(heavy, 2)[0]) < len(split_layers({**costs, "vision": 0.0}, 2)[0])


@pytest.mark.parametrize("name,pp", [("1F1B", 2), ("GPipe", 3), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_vision_stage_holds_no_decoder_layer_and_the_others_every_layer_once(name, pp):
    """dist.pp_vision_stage: stage 0 holds the encoder, projector and embedding and no decoder layer;
    the other stages hold every layer once, in order, cut to minimise the largest of their costs; the
    stages chained in one process give the model's forward and every parameter once."""
    model = _model(6)
    costs = stage_costs(model, 96)
    n = pp * (1 if name in ("1F1B", "GPipe") else 2)
    parts = []
    for rank in range(pp):
        parts += build_stage_models(copy.deepcopy(model), name, rank, pp, 96, vision_stage=True)
    parts.sort(key=lambda p: p.stage)
    assert [p.stage for p in parts] == list(range(n))
    assert parts[0].layer_ids == [] and parts[0].vision is not None and parts[0].decoder.embed is not None
    assert all(p.vision is None and p.decoder.embed is None for p in parts[1:])
    assert [i for p in parts[1:] for i in p.layer_ids] == list(range(6))
    assert all(p.layer_ids for p in parts[1:])
    ranges = [range(p.layer_ids[0], p.layer_ids[-1] + 1) for p in parts[1:]]
    best = max(_stage_loads({**costs, "vision": 0.0}, ranges))
    for cuts in itertools.combinations(range(1, 6), n - 2):  # every contiguous split of stages 1..n-1
        bounds = [0, *cuts, 6]
        other = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        assert best <= max(_stage_loads({**costs, "vision": 0.0}, other)) + 1e-9
    inputs = _inputs(model)
    out = model(**inputs)
    x, aux = inputs["tokens_BS"], None
    for part in parts:
        x, aux = part(x, aux, **inputs)
    torch.testing.assert_close(x, out.hidden_BSD, rtol=1e-5, atol=1e-6)
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters() if not n.startswith("visual_head"))


def test_vision_stage_that_cannot_fit_is_a_one_line_error(corpus, tmp_path):
    from types import SimpleNamespace

    from mmtrain.parallel.pipeline import check_pipeline_config

    with pytest.raises(UserError, match="dist.pp_vision_stage"):
        split_layers(stage_costs(_model(2), 96), 1, vision_stage=True)
    with pytest.raises(UserError, match="dist.pp_vision_stage"):
        split_layers(stage_costs(_model(2), 96), 4, vision_stage=True)  # 3 stages after it, 2 layers
    with pytest.raises(UserError, match="dist.pp_vision_stage") as e:
        tiny_config(corpus, tmp_path / "run", ["dist.pp_vision_stage=true"])  # pp 1: one stage
    assert "\n" not in str(e.value)
    cfg = tiny_config(corpus, tmp_path / "run", ["dist.pp=2", "dist.pp_vision_stage=true",
                                                  "dist.pp_schedule=Interleaved1F1B",
                                                  "model.decoder.n_layers=2"])
    with pytest.raises(UserError, match="dist.pp_vision_stage"):
        check_pipeline_config(cfg, SimpleNamespace(pp=2, ep=1))  # 3 stages after the vision stage
    cfg.model.decoder.n_layers = 3
    check_pipeline_config(cfg, SimpleNamespace(pp=2, ep=1))


def _stage_loads(costs: dict, ranges: list[range]) -> list[float]:
    loads = [sum(costs["layers"][i] for i in r) for r in ranges]
    loads[0] += costs["vision"]
    loads[-1] += costs["head"]
    return loads


@pytest.mark.parametrize("name,pp", [("1F1B", 2), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4),
                                      ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_every_stage_runs_on_exactly_one_rank(name, pp):
    per_rank = [stage_ids(name, r, pp) for r in range(pp)]
    flat = sorted(s for ids in per_rank for s in ids)
    assert flat == list(range(len(flat)))
    if name in ("ZBVZeroBubble", "DualPipeV"):  # V: the first and last stage on rank 0
        assert 0 in per_rank[0] and len(flat) - 1 in per_rank[0]


def test_bad_schedule_names_and_splits_are_one_line_errors():
    with pytest.raises(UserError, match="dist.pp_schedule"):
        schedule_class("1f1b-fast")
    with pytest.raises(UserError, match="dist.pp"):
        split_layers(stage_costs(_model(2), 96), 3)


def _config_file(corpus, tmp_path, overrides) -> str:
    raw = tiny_raw(corpus, tmp_path / "run")
    for item in ["train.grad_accum=4", "model.decoder.moe.first_dense_layers=0", *overrides]:
        apply_override(raw, item)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


CASES = [("1F1B", 2, 4, False), *(pytest.param(*c, marks=pytest.mark.slow) for c in [
    ("Interleaved1F1B", 2, 4, False), ("ZBVZeroBubble", 2, 4, False), ("DualPipeV", 2, 4, False),
    ("Interleaved1F1B", 4, 8, False), ("Interleaved1F1B", 2, 4, True)])]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,pp,layers,ac", CASES)
def test_pipeline_matches_one_process(corpus, tmp_path, schedule, pp, layers, ac):
    """`ac`: activation checkpointing on both sides (the pipeline's applied per stage after the split)."""
    cfg = _config_file(corpus, tmp_path, [f"model.decoder.n_layers={layers}",
                                          f"dist.activation_checkpointing={str(ac).lower()}"])
    out = tmp_path / "out.json"
    launch([WORKER, cfg, str(out), schedule, "5"], nproc=pp, timeout=600)
    got = json.loads(out.read_text())
    assert got["media"] > 0 and got["video"] > 0  # images and video reach stage 0
    for ref, pipe in zip(got["ref"], got["pp"], strict=True):
        assert _rel(ref["loss"], pipe["loss"]) < 1e-5, (ref, pipe)
        assert _rel(ref["grad_norm"], pipe["grad_norm"]) < 1e-5, (ref, pipe)
        assert ref["task_loss"].keys() == pipe["task_loss"].keys()
        for t in ref["task_loss"]:
            assert _rel(ref["task_loss"][t], pipe["task_loss"][t]) < 1e-5
    assert got["weight_diff"] < 1e-5  # the stages gathered into one model: one process's weights
    assert got["ref_bias"].keys() == got["pp_bias"].keys() and got["ref_bias"]
    for layer, bias in got["ref_bias"].items():
        assert any(b != 0 for b in bias)  # the bias moved (the load was uneven)
        for a, b in zip(bias, got["pp_bias"][layer], strict=True):
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)


def test_config_refuses_what_pipelines_do_not_compose_with(corpus, tmp_path):
    from types import SimpleNamespace

    from mmtrain.parallel.config import PP_SCHEDULES
    from mmtrain.parallel.pipeline import SCHEDULES, check_pipeline_config

    assert tuple(SCHEDULES) == PP_SCHEDULES
    cases = {"dist.pp_schedule": (["dist.pp_schedule=DualPipeV"], 2),
             "vision.balance": (["vision.balance=dp"], 1),
             "dist.pp: 4": (["dist.pp_schedule=Interleaved1F1B"], 1)}
    for key, (overrides, ep) in cases.items():
        cfg = tiny_config(corpus, tmp_path / "run", overrides)
        dims = SimpleNamespace(pp=4 if key == "dist.pp: 4" else 2, ep=ep)
        with pytest.raises(UserError, match=key):
            check_pipeline_config(cfg, dims)
    check_pipeline_config(tiny_config(corpus, tmp_path / "run"), SimpleNamespace(pp=2, ep=1))
    with pytest.raises(Exception, match="pp_schedule"):
        tiny_config(corpus, tmp_path / "run", ["dist.pp_schedule=zigzag"])


def test_split_refuses_a_model_already_checkpointed():
    from mmtrain.parallel.parallelize import checkpoint_forward
    from mmtrain.parallel.pipeline import build_stage_models

    model = _model(4)
    checkpoint_forward(model.decoder.layers[0])
    with pytest.raises(ValueError, match="activation checkpointing"):
        build_stage_models(model, "Interleaved1F1B", 0, 2, 96)


def test_pipeline_refuses_loss_terms_it_cannot_run(corpus, tmp_path):
    from mmtrain.loop.pipeline_step import check_pipeline_objective
    from mmtrain.objectives.balance import build_balancer
    from mmtrain.objectives.objective import Objective
    from mmtrain.parallel.distributed import DistEnv

    cfg = tiny_config(corpus, tmp_path / "run", ["loss.visual_ssl.weight=0.1", "model.vision.ssl_head=true"])
    cfg.model.decoder.vocab_size = 300
    model = MultimodalModel(cfg.model)
    obj = Objective(cfg, model, build_balancer(cfg.loss.balancer, {"text": 1.0, "image_text": 1.0,
                                                                   "video_text": 1.0}),
                    env=DistEnv(), device=torch.device("cpu"))
    with pytest.raises(UserError, match="loss.visual_ssl"):
        check_pipeline_objective(obj)


# ----- the trainer at dist.pp > 1 ------------------------------------------------------------------
TRAINER_STEPS = 5


def _trainer_parity(raw_for, tmp_path, nproc: int, overrides: list[str], base=()) -> tuple[dict, dict]:
    """dist_runs' parity worker (Trainer.train_step on the same global rows) in one process and at
    `overrides` on `nproc` ranks."""
    from dist_runs import HERE, parity_reference, write_config

    base = ["data.batch_size=2", "train.grad_accum=2", *base]
    runs = {}
    for name, n, extra in (("one", 1, []), ("pp", nproc, overrides)):
        cfg = write_config(raw_for, tmp_path / name, [*base, *extra])
        if n == 1:
            parity_reference(cfg, tmp_path / "one.json", TRAINER_STEPS)
        else:
            launch([str(HERE), "parity", str(cfg), str(tmp_path / "pp.json"), str(TRAINER_STEPS)], nproc=n)
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    return runs["one"], runs["pp"]


def _check_trainer_parity(one: dict, pp: dict) -> None:
    assert pp["tokens"] == one["tokens"] and pp["task_tokens"] == one["task_tokens"]
    seen = {t: sum(step[t] for step in one["task_tokens"]) for t in one["task_tokens"][0]}
    assert all(n > 0 for n in seen.values()), seen  # text, images and video in the rows
    for key in ("loss", "grad_norm"):
        for a, b in zip(one[key], pp[key], strict=True):
            assert _rel(a, b) < 1e-5, (key, one[key], pp[key])
    assert len(pp["expert_bias"]) == TRAINER_STEPS and any(any(b) for b in one["expert_bias"][-1])
    for step_one, step_pp in zip(one["expert_bias"], pp["expert_bias"], strict=True):
        for layer_one, layer_pp in zip(step_one, step_pp, strict=True):
            for a, b in zip(layer_one, layer_pp, strict=True):
                assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)
    for a, b in zip(one["parts"], pp["parts"], strict=True):  # grad_norm/*, update_ratio/* per part
        assert a.keys() == b.keys() and all(_rel(a[k], b[k]) < 1e-4 for k in a), (a, b)
    if pp["attn"]:  # whole rows (no cp / tp): every stage's layers counted, summed over the world
        assert pp["attn"].keys() == one["attn"].keys(), (one["attn"], pp["attn"])
        for i, a in one["attn"].items():
            assert a["sparse"] == pp["attn"][i]["sparse"]
            assert all(_rel(a[k], pp["attn"][i][k]) < 1e-9 for k in ("kept_frac", "keys_per_token")), (a, pp)


@pytest.mark.distributed
def test_trainer_at_pp2_matches_one_process(raw_for, tmp_path):
    """`mmtrain train`'s step at PP(2) x 1F1B (2 ranks, gloo): the losses, gradient norms (global and
    per part), token counts and MoE expert biases of one process on the same rows, step by step, with
    tiny's next-visual-token term (its head on the last stage)."""
    one, pp = _trainer_parity(raw_for, tmp_path, 2, ["dist.pp=2"],
                              base=["model.visual_head=true", "loss.visual_next.weight=1"])
    _check_trainer_parity(one, pp)
    # the attention counts of every layer reach the log from the stage holding it; the sparse layer
    # really selects (kept 46% of the reachable blocks here)
    assert len(pp["attn"]) == 2 and any(a["sparse"] and a["kept_frac"] <= 0.5 for a in pp["attn"].values())


@pytest.mark.distributed
def test_trainer_at_tp2_pp2_matches_one_process(raw_for, tmp_path):
    """TP(2) x PP(2) (4 ranks): each tp rank of a stage holds its sequence-parallel chunk of every row
    and hands it to the same tp rank of the next stage (Megatron's way); the same losses, gradient
    norms and expert biases as one process, with the tp collectives seen to run."""
    one, pp = _trainer_parity(raw_for, tmp_path, 4, ["dist.pp=2", "dist.tp=2"],
                              base=["model.decoder.n_kv_heads=2"])
    _check_trainer_parity(one, pp)
    assert pp["traffic"]["tp_all_gather"] > 0 and pp["traffic"]["tp_reduce_scatter"] > 0


# ----- checkpoints across pp, fsdp and one process ---------------------------------------------------
def _saved_and_loaded(make_raw, tmp_path, save_nproc: int, saved_at: list[str], loaded: dict) -> dict:
    """Train 2 steps at `saved_at` on `save_nproc` ranks, then resume the checkpoint at each of
    `loaded` ({name: (nproc, dist overrides)}): -> {name: the full model and optimizer state}."""
    from dist_runs import train, write_config
    from test_tensor_parallel import _state

    ref = tmp_path / "ref"
    config = write_config(make_raw, ref, ["train.steps=2", "train.grad_accum=2", *saved_at])
    train(config, save_nproc)
    runs = {}
    for name, (nproc, overrides) in loaded.items():
        run = tmp_path / name
        run.mkdir()
        (run / "step_2").symlink_to(ref / "step_2", target_is_directory=True)
        runs[name] = _state(config, run, nproc, tmp_path, overrides)
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("loaded", [
    pytest.param({"one": (1, ["dist.pp=1"]), "pp2": (2, [])}, id="pp2-to-one",  # CI: the killed run's
                 marks=pytest.mark.slow),
    pytest.param({"one": (1, ["dist.pp=1"]), "fsdp2": (2, ["dist.pp=1"])}, id="pp2-to-fsdp2",
                 marks=pytest.mark.slow)])
def test_state_saved_at_pp2_is_the_state_loaded_in_one_process_and_at_fsdp2(make_raw, tmp_path, loaded):
    """DCP reshards the stages' state (full-model names on each stage's rank) to any mesh: the model
    and optimizer state loaded at PP(2) itself, at FSDP(2) and in one process are one state."""
    from test_tensor_parallel import _assert_same_state

    runs = _saved_and_loaded(make_raw, tmp_path, 2, ["dist.pp=2"], loaded)
    assert runs["one"]["step"] == 2 and runs["one"]["optim"]
    for name in set(loaded) - {"one"}:
        _assert_same_state(runs[name], runs["one"], f"pp2->{name}")


@pytest.mark.distributed
@pytest.mark.slow
def test_state_saved_at_fsdp2_is_the_state_loaded_at_pp2(make_raw, tmp_path):
    from test_tensor_parallel import _assert_same_state

    runs = _saved_and_loaded(make_raw, tmp_path, 2, ["dist.pp=1"],
                             {"one": (1, []), "pp2": (2, ["dist.pp=2"])})
    _assert_same_state(runs["pp2"], runs["one"], "fsdp2->pp2")


_BEYOND_CI = pytest.mark.slow
COMPILED = ["dist.compile=true", "dist.compile_backend=aot_eager"]


@pytest.mark.distributed
@pytest.mark.parametrize("first, then, extra", [
    pytest.param((2, "dist.pp=2"), (1, "dist.pp=1"), [], id="pp2-to-one"),
    pytest.param((1, "dist.pp=1"), (2, "dist.pp=2"), [], id="one-to-pp2", marks=_BEYOND_CI),
    # compiled stages save their blocks' weights under the model's names (no `_orig_mod.`)
    pytest.param((2, "dist.pp=2"), (1, "dist.pp=1"), COMPILED, id="pp2-compiled-to-one", marks=_BEYOND_CI)])
def test_killed_at_pp2_resumed_in_one_process_continues_the_run(make_raw, tmp_path, first, then, extra):
    """PP(2) and one process read the same rows (one data slot), so a run killed at one and resumed
    at the other continues the uninterrupted run's losses, and ends with its evaluation."""
    from dist_runs import checkpoint_names, losses, reference_run, train, write_config

    ref, run = tmp_path / "ref", tmp_path / "run"
    base = ["train.grad_accum=2", first[1], *extra]
    reference_run(write_config(make_raw, ref, base), first[0])
    config = write_config(make_raw, run, base)
    assert train(config, first[0], "train.faults.kill_at_step=5", check=False).returncode != 0
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, then[0], then[1])
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)
    # the last evaluation: at PP(2) on the replica gathered from the stages, in one process on the model
    ends = [json.loads((r / "summary.json").read_text())["end"]["loss"] for r in (ref, run)]
    assert ends[0].keys() == ends[1].keys()
    assert all(_rel(ends[0][t], ends[1][t]) < 1e-5 for t in ends[0]), ends


@pytest.mark.distributed
@pytest.mark.parametrize("sets, nproc, mesh", [
    pytest.param(["dist.pp=2"], 2, "dp_shard=1 cp=1 ep=1 pp=2 (world 2)", id="pp2"),
    pytest.param(["dist.pp=2", "dist.tp=2", "model.decoder.n_kv_heads=2"], 4,
                 "dp_shard=1 cp=1 ep=1 tp=2 pp=2 (world 4)", id="tp2-pp2",
                 marks=pytest.mark.slow)])
def test_mmtrain_under_torchrun_with_pp2_runs_evaluation_diagnostics_and_captions(make_raw, tmp_path, sets,
                                                                                   nproc, mesh):
    """As a user runs it: torchrun starting the `mmtrain` console script, `--set dist.pp=2` (and
    `dist.tp=2`). Training runs the stages; evaluation, diagnostics (with the reliance guard's gaps)
    and captioning run on the replica gathered from them (docs/DISTRIBUTED.md); the run ends with a
    checkpoint."""
    import sys
    from pathlib import Path

    from dist_runs import write_config

    run = tmp_path / "run"
    config = write_config(make_raw, run, [
        "train.steps=4", "train.ckpt_every=0", "train.grad_accum=2", "diagnostics.every=2",
        "diagnostics.batches=1", "diagnostics.warmup_steps=0", "loss.balancer.kind=reliance_guard",
        "captions.images=2", "captions.videos=1", "train.eval_batches=0", "diagnostics.probe_media=3"])
    mmtrain = str(Path(sys.executable).parent / "mmtrain")
    sets = [a for kv in sets for a in ("--set", kv)]
    launch(["--no-python", mmtrain, "train", str(config), "--quiet", *sets], nproc=nproc)
    diags = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diags] == [0, 2, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["end"]["mismatch_gap"]) == {"image_text", "video_text"}
    assert summary["end"]["captions"]["prompts"] == 3 and (run / "step_4").is_dir()
    assert mesh in (run / "train.log").read_text()


MESHES = {  # (ranks, overrides): the trainer at other pipeline meshes (MMTRAIN_SLOW_TESTS=1)
    "pp2-interleaved": (2, ["dist.pp=2", "dist.pp_schedule=Interleaved1F1B"]),
    "pp2-zbv": (2, ["dist.pp=2", "dist.pp_schedule=ZBVZeroBubble"]),
    "pp2-gpipe": (2, ["dist.pp=2", "dist.pp_schedule=GPipe"]),
    "pp2-ac": (2, ["dist.pp=2", "dist.activation_checkpointing=true"]),
    "pp2-fsdp2": (4, ["dist.pp=2"]),
    "pp2-ep2": (4, ["dist.pp=2", "dist.ep=2"]),
    "pp2-dualpipev": (2, ["dist.pp=2", "dist.pp_schedule=DualPipeV", "train.grad_accum=4"]),
    "pp4-interleaved": (4, ["dist.pp=4", "dist.pp_schedule=Interleaved1F1B", "train.grad_accum=4"]),
    # two stages a rank: each a deep copy, split over tp after the cut
    "tp2-pp2-interleaved": (4, ["dist.pp=2", "dist.tp=2", "dist.pp_schedule=Interleaved1F1B",
                                "model.decoder.n_kv_heads=2"]),
    # dist.compile: each stage's blocks compiled (aot_eager: Dynamo + AOTAutograd, no code generation)
    "pp2-compile": (2, ["dist.pp=2", "dist.compile=true", "dist.compile_backend=aot_eager"]),
    "tp2-pp2-compile": (4, ["dist.pp=2", "dist.tp=2", "dist.compile=true", "dist.compile_backend=aot_eager",
                            "model.decoder.n_kv_heads=2"]),
    # context parallelism on the stages: each cp rank's chunk crosses the boundary, K/V fetched per layer
    "cp2-pp2": (4, ["dist.pp=2", "dist.cp=2", "model.decoder.attention.full_tile=16"]),
    # dist.pp_vision_stage: stage 0 the encoder and embedding alone, the layers on the other stages
    "pp2-vision-stage": (2, ["dist.pp=2", "dist.pp_vision_stage=true"]),
    "pp2-interleaved-vision-stage": (2, ["dist.pp=2", "dist.pp_schedule=Interleaved1F1B",
                                         "dist.pp_vision_stage=true"]),
    "pp2-zbv-vision-stage": (2, ["dist.pp=2", "dist.pp_schedule=ZBVZeroBubble", "dist.pp_vision_stage=true"]),
    "pp2-dualpipev-vision-stage": (2, ["dist.pp=2", "dist.pp_schedule=DualPipeV", "dist.pp_vision_stage=true",
                                       "train.grad_accum=4"]),
    "tp2-pp2-vision-stage": (4, ["dist.pp=2", "dist.tp=2", "dist.pp_vision_stage=true",
                                 "model.decoder.n_kv_heads=2"]),
    # dist.pp_split: measured (the parts timed on each rank, the max all-reduced, then cut)
    "pp2-measured-vision-stage": (2, ["dist.pp=2", "dist.pp_split=measured", "dist.pp_vision_stage=true",
                                      "dist.pp_schedule=Interleaved1F1B"]),
}
LAYERS = {"pp4-interleaved": 8}  # a rank's two stages x 4 ranks


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_trainer_at_pipeline_meshes_matches_one_process(raw_for, tmp_path, mesh):
    nproc, overrides = MESHES[mesh]
    layers = LAYERS.get(mesh, 4)
    accum = [o for o in overrides if not o.startswith("dist.")]  # both sides
    one, pp = _trainer_parity(raw_for, tmp_path, nproc, overrides,
                              base=[f"model.decoder.n_layers={layers}", *accum])
    _check_trainer_parity(one, pp)
    assert one["graphs"] == 0 and (pp["graphs"] > 0) == ("dist.compile=true" in overrides)


@pytest.mark.parametrize("overrides, world, key", [
    (["dist.tp=2"], 4, "model.decoder.n_kv_heads"),  # tp's own rules hold on the stages too
    (["dist.ep=2", "model.decoder.moe=null"], 4, "dist.ep"),
])
def test_trainer_refuses_pipeline_meshes_it_does_not_build(corpus, tmp_path, overrides, world, key):
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.pipeline_model import check_pipeline_mesh

    cfg = tiny_config(corpus, tmp_path / "run", ["dist.pp=2", *overrides])
    with pytest.raises(UserError) as e:
        check_pipeline_mesh(cfg, ParallelDims.from_config(cfg.dist, world))
    assert key in str(e.value) and "\n" not in str(e.value)
    fsdp = tiny_config(corpus, tmp_path / "run", ["dist.pp=2"])
    check_pipeline_mesh(fsdp, ParallelDims.from_config(fsdp.dist, 4))  # PP(2) x FSDP(2) builds
    tp = tiny_config(corpus, tmp_path / "run", ["dist.pp=2", "dist.tp=2", "model.decoder.n_kv_heads=2"])
    check_pipeline_mesh(tp, ParallelDims.from_config(tp.dist, 4))  # PP(2) x TP(2) builds
    cp = tiny_config(corpus, tmp_path / "run",
                     ["dist.pp=2", "dist.cp=2", "model.decoder.attention.full_tile=16"])
    check_pipeline_mesh(cp, ParallelDims.from_config(cp.dist, 4))  # PP(2) x CP(2) builds
