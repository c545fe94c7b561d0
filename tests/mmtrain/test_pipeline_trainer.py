"""The trainer at dist.pp > 1 (mmtrain/parallel/pipeline_model.py, mmtrain/loop/train_module.py): its
steps give one process's losses, gradient norms and MoE expert biases on the same rows (PP(2) x 1F1B
with tiny's next-visual-token term and TP(2) x PP(2) in CI, the other meshes and schedules with
MMTRAIN_SLOW_TESTS=1); checkpoints reshard between PP, FSDP and one process; a killed run resumes;
the console script under torchrun evaluates, diagnoses and captions. The stage split and the
schedules in one process: test_pipeline.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import tiny_config
from dist_runs import launch
from test_pipeline import _rel

from mmtrain.errors import UserError

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
    """`mmtrain train`'s step at PP(2) x 1F1B (2 ranks, gloo) with configs/tiny.yaml's grad_accum 1:
    each batch's 4 rows split into the schedule's 2 micro-batches (torch refuses 1), and the losses,
    gradient norms (global and per part), token counts and MoE expert biases of one process on the
    same rows, step by step, with tiny's next-visual-token term (its head on the last stage): every
    term's mean is the batch's, not the micro-batch's."""
    one, pp = _trainer_parity(raw_for, tmp_path, 2, ["dist.pp=2"],
                              base=["data.batch_size=4", "train.grad_accum=1", "model.visual_head=true",
                                    "loss.visual_next.weight=1"])
    _check_trainer_parity(one, pp)
    # the attention counts of every layer reach the log from the stage holding it; the sparse layer
    # really selects (kept 46% of the reachable blocks here)
    assert len(pp["attn"]) == 2 and any(a["sparse"] and a["kept_frac"] <= 0.5 for a in pp["attn"].values())


@pytest.mark.distributed
def test_trainer_at_pp2_with_the_contrast_matches_one_process(raw_for, tmp_path):
    """The mismatch contrast at PP(2) x 1F1B, grad_accum 1: the batch is extended whole (its copies'
    donors are the batch's, as one process's), each row part carries its own rows' copies, padded to
    the stages' fixed rows, and every mean (task CE, hinge over documents, visual_next, MoE aux) is
    one process's forward's."""
    one, pp = _trainer_parity(raw_for, tmp_path, 2, ["dist.pp=2"],
                              base=["data.batch_size=4", "train.grad_accum=1", "model.visual_head=true",
                                    "loss.visual_next.weight=1", "loss.contrast.weight=1"])
    _check_trainer_parity(one, pp)


@pytest.mark.distributed
def test_trainer_at_pp2_with_token_weighting_matches_one_process(raw_for, tmp_path):
    """loss.token_weighting at PP(2) x 1F1B, grad_accum 1, with tiny's objective and the contrast:
    the blank pass runs through the stages forward only (frozen, before the schedule), and, the
    batch being split in two, a second pass with the media gives each part its batch's reliance
    means, which one process takes before any backward."""
    one, pp = _trainer_parity(raw_for, tmp_path, 2, ["dist.pp=2"],
                              base=["data.batch_size=4", "train.grad_accum=1", "model.visual_head=true",
                                    "loss.visual_next.weight=1", "loss.contrast.weight=1",
                                    "loss.token_weighting.strength=1"])
    _check_trainer_parity(one, pp)


@pytest.mark.distributed
def test_trainer_at_pp2_with_visual_ssl_matches_one_process(raw_for, tmp_path):
    """loss.visual_ssl at PP(2) x 1F1B with the vision encoder's own stage (dist.pp_vision_stage:
    stage 0 holds no decoder layer), grad_accum 1: stage 0's masked-patch loss crosses the stages
    with the MoE aux losses and its gradient comes back; each row part hides the batch's mask's
    patches of its rows, its mean weighted by its share of them."""
    one, pp = _trainer_parity(raw_for, tmp_path, 2, ["dist.pp=2", "dist.pp_vision_stage=true"],
                              base=["data.batch_size=4", "train.grad_accum=1", "model.vision.ssl_head=true",
                                    "loss.visual_ssl.weight=1", "loss.visual_ssl.media_share=0.5"])
    _check_trainer_parity(one, pp)


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


# ----- GradNorm at dist.pp > 1 -----------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("nproc, rows", [
    pytest.param(2, 4, id="pp2"),
    # the last stage's two data ranks each form their rows' head gradients (the FSDP-gathered head),
    # summed with stage 0's zeros (MMTRAIN_SLOW_TESTS=1; pp2 keeps the path in CI)
    pytest.param(4, 8, id="pp2-fsdp2", marks=pytest.mark.slow)])
def test_gradnorm_at_pp2_matches_one_process(raw_for, tmp_path, nproc, rows):
    """GradNorm at PP(2) x 1F1B with each batch's rows split into the schedule's 2 micro-batches:
    the per-task LM-head gradients form on the last stage (each part's over its whole batch's
    counts), stage 0 joins the step's all-reduce with zeros, so every rank's balancer takes one
    process's weights and per-task head norms, step by step (rank 0, whose stage has no head, writes
    them; the last stage's weights are the losses')."""
    one, pp = _trainer_parity(raw_for, tmp_path, nproc, ["dist.pp=2"],
                              base=[f"data.batch_size={rows}", "train.grad_accum=1",
                                    "loss.balancer.kind=gradnorm", "loss.balancer.lr=0.5"])
    _check_trainer_parity(one, pp)
    for got, want in zip(pp["balance"], one["balance"], strict=True):  # weights, GradNorm's head norms
        assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-5, abs=0), (got, want)
    assert any(abs(pp["balance"][-1][t] - 1) > 1e-3 for t in ("text", "image_text", "video_text"))
