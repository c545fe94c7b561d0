"""Pipeline parallelism (mmtrain/parallel/pipeline.py, mmtrain/loop/pipeline_step.py).

The stages chained in one process give the model's forward; the split minimises the largest stage
cost; and over gloo, PP ranks under a named schedule give one process's losses, gradient norms and
MoE expert biases on the same rows (rows with images, video and interleaved documents, sparse layers
that select, MoE): PP(2) x 1F1B in CI, the other schedules and PP(4) with MMTRAIN_SLOW_TESTS=1.
`dist.pp_vision_stage` (the encoder's own stage 0): its split and chained stages. The trainer at
dist.pp > 1 (its meshes, checkpoints, resume, the console script): test_pipeline_trainer.py.
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
