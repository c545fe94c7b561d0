"""Tensor (+ sequence) parallelism on CPU with gloo (mmtrain/parallel/tensor_parallel.py): a run at
TP(2), TP(4), FSDP(2) x TP(2), TP(2) x CP(2), TP(2) x EP(2), FSDP(2) x CP(2) x TP(2) x EP(2),
HSDP(2x2) x TP(2) x EP(2) and compiled TP(2) give the losses, gradient norms and MoE expert
biases of one process on the same rows, over 5 steps of the tiny corpus (images, video,
interleaved documents; MoE layers; sparse layers that select); config the TP split cannot serve
is a one-line error naming the key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from dist_runs import HERE as WORKER
from dist_runs import launch, parity_reference, train, write_config

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow  # make test-slow
STEPS = 5
HEADS = {2: ["model.decoder.n_kv_heads=2"],  # a tp rank holds whole KV groups
         4: ["model.decoder.n_heads=4", "model.decoder.n_kv_heads=4",
             "model.decoder.mrope_sections=[1, 1, 2]"]}
TILE = ["model.decoder.attention.full_tile=16"]  # under cp: chunks of whole tiles
MESHES = {  # (ranks, rows, overrides)
    "tp2": (2, 2, ["dist.tp=2", *HEADS[2]]),
    "tp4": (4, 2, ["dist.tp=4", *HEADS[4]]),
    "fsdp2-tp2": (4, 2, ["dist.tp=2", *HEADS[2]]),
    "tp2-cp2": (4, 2, ["dist.tp=2", "dist.cp=2", *HEADS[2], *TILE]),
    # the contrast's copies split over tp as any row (its CP(2) case is the fast one: test_distributed)
    "tp2-contrast": (2, 2, ["dist.tp=2", *HEADS[2], "loss.contrast.weight=1"]),
    # token weighting's blank pass sharded over tp as the training forward (its CP(2) case is the fast one)
    "tp2-token-weighting": (2, 2, ["dist.tp=2", *HEADS[2], "loss.token_weighting.strength=1"]),
    # GradNorm's head gradients from each tp rank's tokens against the whole (replicated) LM head,
    # summed over the world (its CP(2) case, the same row-chunk path, is the fast one: test_distributed)
    "tp2-gradnorm": (2, 2, ["dist.tp=2", *HEADS[2], "loss.balancer.kind=gradnorm", "loss.balancer.lr=0.5"]),
    # each tp rank routes its own tokens within its ep group; FSDP sums the experts' grads over tp
    "tp2-ep2": (4, 2, ["dist.tp=2", "dist.ep=2", *HEADS[2]]),
    "hsdp2x2-tp2-ep2": (8, 4, ["dist.dp_replicate=2", "dist.tp=2", "dist.ep=2", *HEADS[2]]),
    "fsdp2-cp2-tp2-ep2": (8, 2, ["dist.tp=2", "dist.cp=2", "dist.ep=2", *HEADS[2], *TILE]),
    # the compiled layers call the tp collectives (aot_eager: the graphs Inductor would receive)
    "tp2-compile": (2, 2, ["dist.tp=2", "dist.compile=true", "dist.compile_backend=aot_eager", *HEADS[2]]),
    # the recompute reissues the tp collectives; accumulation defers FSDP's (tp-summing) reduce
    "tp2-ac-accum": (2, 2, ["dist.tp=2", "dist.activation_checkpointing=true", "train.grad_accum=2",
                            *HEADS[2]]),
}


def _parity(raw_for, tmp_path, mesh: str) -> tuple[dict, dict]:
    nproc, rows, overrides = MESHES[mesh]
    base = [f"data.batch_size={rows}", *(o for o in overrides if not o.startswith("dist."))]
    one_cfg = write_config(raw_for, tmp_path / "one", base)
    parity_reference(one_cfg, tmp_path / "one.json", STEPS)
    config = write_config(raw_for, tmp_path / "run", [*base, *overrides])
    launch([str(WORKER), "parity", str(config), str(tmp_path / "tp.json"), str(STEPS)], nproc=nproc)
    return tuple(json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp"))


def _check(one: dict, tp: dict) -> None:
    assert tp["tokens"] == one["tokens"]
    assert tp["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert tp["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5, abs=0)
    assert tp["expert_bias"] == one["expert_bias"]  # the same expert loads, step by step
    assert tp["traffic"]["tp_all_gather"] > 0 and tp["traffic"]["tp_reduce_scatter"] > 0
    for got, want in zip(tp["balance"], one["balance"], strict=True):  # weights, GradNorm's head norms
        assert got == pytest.approx(want, rel=1e-5, abs=0)


@pytest.mark.parametrize("mesh", ["tp2", "tp2-ep2"])
def test_tensor_parallel_ranks_match_one_process(raw_for, tmp_path, mesh):
    _check(*_parity(raw_for, tmp_path, mesh))


@SLOW
@pytest.mark.parametrize("mesh", ["tp4", "fsdp2-tp2", "tp2-cp2", "tp2-contrast", "tp2-gradnorm",
                                  "tp2-token-weighting", "tp2-ac-accum", "tp2-compile",
                                  "fsdp2-cp2-tp2-ep2", "hsdp2x2-tp2-ep2"])
def test_tensor_parallel_meshes_match_one_process(raw_for, tmp_path, mesh):
    one, tp = _parity(raw_for, tmp_path, mesh)
    _check(one, tp)
    if "gradnorm" in mesh:  # the weights did move
        assert any(abs(tp["balance"][-1][t] - 1) > 1e-3 for t in ("text", "image_text", "video_text"))
    assert one["graphs"] == 0 and (tp["graphs"] > 0) == ("dist.compile=true" in MESHES[mesh][2])


@pytest.mark.parametrize("overrides, key", [
    ([], "model.decoder.n_kv_heads"),  # the tiny model's one KV head cannot split
    ([*HEADS[2], "model.decoder.ffn_dim=63"], "model.decoder.ffn_dim"),
    ([*HEADS[2], "data.seq_len=191"], "data.seq_len"),
])
def test_what_tp_cannot_split_is_one_line_naming_the_key(make_config, tmp_path, overrides, key):
    from mmtrain.errors import UserError
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.tensor_parallel import check_tp

    cfg = make_config(tmp_path, ["dist.tp=2", *overrides])
    with pytest.raises(UserError) as e:
        check_tp(cfg, ParallelDims.from_config(cfg.dist, 2))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_mmtrain_under_torchrun_with_tp2_runs_evaluation_diagnostics_and_captions(make_raw, tmp_path):
    """As a user runs it: torchrun starting the `mmtrain` console script, `--set dist.tp=2`.
    Training forwards split the rows between the tp ranks; evaluating ones (eval, diagnostics
    with the attention measures, the reliance guard's gaps) take them whole on both ranks, the
    split layers reducing their partial sums; captioning decodes from a gathered replica."""
    run = tmp_path / "run"
    config = write_config(make_raw, run, [
        "train.steps=4", "train.ckpt_every=0", "diagnostics.every=2", "diagnostics.batches=1",
        "diagnostics.warmup_steps=0", "loss.balancer.kind=reliance_guard", "model.vision.ssl_head=true",
        "loss.visual_ssl.weight=0.5", "captions.images=2", "captions.videos=1", "train.eval_batches=0",
        "diagnostics.probe_media=3", *HEADS[2]])
    mmtrain = str(Path(sys.executable).parent / "mmtrain")
    launch(["--no-python", mmtrain, "train", str(config), "--quiet", "--set", "dist.tp=2"], nproc=2)
    diags = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diags] == [0, 2, 4]
    assert all(set(d["reliance_gap"]) <= {"image_text", "video_text"} for d in diags)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["end"]["mismatch_gap"]) == {"image_text", "video_text"}
    assert summary["end"]["captions"]["prompts"] == 3
    assert "mesh dp_replicate=1 dp_shard=1 cp=1 ep=1 tp=2 (world 2)" in (run / "train.log").read_text()


# ----- checkpoints across tp and fsdp --------------------------------------------------------------
def _state(config, run, nproc: int, tmp_path, overrides=()) -> dict:
    import torch
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["run_dir"] = str(run)
    for item in overrides:
        key, value = item.split("=")
        raw["dist"][key.removeprefix("dist.")] = yaml.safe_load(value)
    path = tmp_path / f"state-{run.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / f"state-{run.name}.pt"
    launch([str(WORKER), "state", str(path), str(out)], nproc)
    return torch.load(out, weights_only=True)


def _assert_same_state(got: dict, want: dict, name: str) -> None:
    import torch

    assert got["step"] == want["step"] and got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), (name, key)
    assert got["optim"].keys() == want["optim"].keys()
    for key, slots in want["optim"].items():
        for slot, value in slots.items():
            assert torch.equal(got["optim"][key][slot], value), (name, key, slot)


@pytest.mark.parametrize("saved_at, loaded_at", [
    pytest.param(["dist.tp=2"], ["dist.tp=1"], id="tp2-to-fsdp2"),
    pytest.param(["dist.tp=1"], ["dist.tp=2"], id="fsdp2-to-tp2", marks=SLOW)])
def test_state_saved_at_one_mesh_is_the_state_loaded_at_the_other_and_in_one_process(
        make_raw, tmp_path, saved_at, loaded_at):
    ref = tmp_path / "ref"
    config = write_config(make_raw, ref, ["train.steps=2", *HEADS[2], *saved_at])
    train(config, 2)
    runs = {}
    for name, nproc, overrides in (("other", 2, loaded_at), ("one", 1, ["dist.tp=1"])):
        run = tmp_path / name
        run.mkdir()
        (run / "step_2").symlink_to(ref / "step_2", target_is_directory=True)
        runs[name] = _state(config, run, nproc, tmp_path, overrides)
    assert runs["one"]["step"] == 2
    _assert_same_state(runs["other"], runs["one"], "->".join(saved_at + loaded_at))


@SLOW
@pytest.mark.parametrize("first, then", [(4, 2), (2, 4)], ids=["fsdp2xtp2-to-fsdp2", "fsdp2-to-fsdp2xtp2"])
def test_killed_at_one_mesh_resumed_at_the_other_continues_the_run(make_raw, tmp_path, first, then):
    """The same 2 data-parallel slots at both meshes (FSDP(2) x TP(2) on 4 ranks, FSDP(2) on 2), so
    the data position resumes exactly and the losses are the uninterrupted run's."""
    from dist_runs import checkpoint_names, losses

    tp = {4: "dist.tp=2", 2: "dist.tp=1"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    base = ["data.batch_size=1", *HEADS[2]]
    train(write_config(make_raw, ref, [*base, tp[first]]), first)
    config = write_config(make_raw, run, [*base, tp[first]])
    assert train(config, first, "train.faults.kill_at_step=5", check=False).returncode != 0
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, then, tp[then])
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)


@SLOW
def test_killed_at_tp2_ep2_resumed_continues_the_run(make_raw, tmp_path):
    """TP(2) x EP(2) on 4 ranks: the experts' (efsdp x tp, ep) shards go through DCP and back."""
    from dist_runs import checkpoint_names, losses

    ref, run = tmp_path / "ref", tmp_path / "run"
    base = ["data.batch_size=1", *HEADS[2], "dist.tp=2", "dist.ep=2"]
    train(write_config(make_raw, ref, base), 4)
    config = write_config(make_raw, run, base)
    assert train(config, 4, "train.faults.kill_at_step=5", check=False).returncode != 0
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, 4)
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)
