"""Hang-freedom: whatever each rank's batch holds, every rank makes the same collectives.

The real trainer (mesh, model, objective: contrast, visual_next, token weighting where the mesh
allows them; MoE token chunks small enough to split) trains a few steps on per-rank batches of
every shape the data can take (hang_worker.py: row subsets, padding-only context chunks, no media,
the one-row pad batch), then evaluates shards of different lengths, on gloo with a short collective
timeout, so a hang fails the test instead of blocking CI. And when a collective does time out,
each rank names the one it waited in and where it was called from.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_runs import launch, write_config

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).resolve().parent / "hang_worker.py"
SLOW = pytest.mark.slow  # make test-slow
TP_HEADS = ["model.decoder.n_kv_heads=2"]  # a tp rank holds whole KV groups
ALL_TERMS = ["loss.contrast.weight=1", "loss.token_weighting.strength=0.5"]
BASE = ["dist.timeout_s=15", "model.visual_head=true", "loss.visual_next.weight=1",
        "model.decoder.ffn_chunk=96", "model.decoder.attention.full_tile=16", "data.batch_size=2"]
PP = ["dist.pp=2", "train.grad_accum=2"]  # 2 micro-batches: one a stage
MESHES = {  # (ranks, overrides)
    "fsdp2": (2, [*ALL_TERMS, "vision.balance=dp"]),  # media exchanged: a rank may hold none
    "hsdp2x2-ep2": (4, ["dist.dp_replicate=2", "dist.ep=2", "dist.activation_checkpointing=true",
                        *ALL_TERMS]),
    # ffn_chunk on without activation checkpointing: its chunks checkpoint, so the grouped_mm probe
    # must have run before the first one (a probe inside one broke its recompute: CheckpointError)
    # the contrast's per-document sums over the cp group: a copy whose chunk is padding still joins;
    # token weighting's blank pass: rows chosen from the whole rows, a chunk without media joins it
    "cp2": (2, ["dist.cp=2", "vision.balance=dp_cp", *ALL_TERMS]),
    # a data rank without media joins the others' blank pass with the pad batch, split over its cp group
    "fsdp2-cp2-ep2": (4, ["dist.cp=2", "dist.ep=2", "dist.activation_checkpointing=true",
                          "loss.token_weighting.strength=0.5"]),
    # tp: the sequence chunk is the (cp, tp) group's, so `tail` leaves the last tp rank padding only
    "tp2": (2, ["dist.tp=2", *TP_HEADS, *ALL_TERMS]),
    # pp: the two data ranks' micro-batches differ (all-padding, media-free) while each pipeline's two
    # stages read the same ones; the contrast pads every forward to twice its rows (a micro-batch
    # without media: all padding copies), token weighting's frozen passes and the reduce of their sums
    # join on every stage, the whole-row counts' all-reduce on every rank
    "pp2-fsdp2": (4, [*PP, *ALL_TERMS]),
    # grad_accum 1: each batch's 2 rows in the schedule's 2 row parts (one of them may hold no media)
    "pp2-fsdp2-row-parts": (4, ["dist.pp=2", "train.grad_accum=1", *ALL_TERMS]),
    # MoE's chunk count (BASE's ffn_chunk) is agreed over the stage, not the world: the other stage
    # runs other layers (it hung at the first step when it was the world)
    "pp2-ep2": (4, [*PP, "dist.ep=2"]),
    # FSDP2's bf16 policy on gloo (dist.cpu_mixed_precision): the stages send bf16, so the boundary
    # is declared bf16 (declared fp32, gloo timed out on the size: what hangs NCCL on a GPU)
    "pp2-fsdp2-bf16": (4, [*PP, "train.dtype=bfloat16", "dist.cpu_mixed_precision=true"]),
}
SLOW_MESHES = {
    "pp2": (2, [*PP]),
    "tp2-pp2": (4, [*PP, "dist.tp=2", *TP_HEADS]),
    "tp2-cp2": (4, ["dist.tp=2", "dist.cp=2", *TP_HEADS]),
    "fsdp2-tp2-ep2-ac": (4, ["dist.tp=2", "dist.ep=2", "dist.activation_checkpointing=true", *TP_HEADS]),
}


@pytest.mark.parametrize("mesh", [*MESHES, *(pytest.param(m, marks=SLOW) for m in SLOW_MESHES)])
def test_fuzzed_per_rank_batches_never_hang(raw_for, tmp_path, mesh, monkeypatch):
    nproc, overrides = {**MESHES, **SLOW_MESHES}[mesh]
    if "bf16" in mesh:  # torch's stages check what they send and receive against the declared metadata
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    config = write_config(raw_for, tmp_path / "run", [*BASE, *overrides])
    out = tmp_path / "fuzz.json"
    run = launch([str(WORKER), "fuzz", str(config), "0", "3", str(out)], nproc, timeout=150, check=False)
    named = [t for t in run.stderr.splitlines() if t.startswith("mmtrain: rank") or "Error:" in t]
    assert run.returncode == 0, "\n".join(named) or run.stderr[-4000:]  # the collective each rank was in
    batches = json.loads(out.read_text())["batches"]
    assert len({b[0] for b in batches}) == min(5, len(batches))  # rank 0's micro-batches took that many
    # shapes (the others, others)


@pytest.mark.parametrize("case", ["all_reduce", "all_to_all", "p2p"])
def test_a_timed_out_collective_names_itself_and_its_call_site_on_each_rank(tmp_path, case):
    """Rank 1 skips one (an all-reduce; the all-to-all that EP and CP call through comm.py; the send
    of a pipeline stage's receive, which gloo would wait for with no deadline)."""
    out = tmp_path / "note"
    launch([str(WORKER), "mismatch", str(out), case], nproc=2, timeout=60)
    lines = WORKER.read_text().splitlines()
    skipped = next(i for i, t in enumerate(lines, 1) if t.endswith(f"# SKIPPED-BY-RANK-1 {case}"))
    waits = next(i for i, t in enumerate(lines, 1) if t.endswith("# RANK-1-WAITS"))
    note0, note1 = (Path(f"{out}.{r}").read_text() for r in (0, 1))
    op, group, shape = {"all_reduce": ("all_reduce", "world", "(3,)"),
                        "all_to_all": ("all_to_all_single", "world", "(2,), (2,)"),
                        "p2p": ("p2p recv", "default_pg [0, 1]", "irecv (3,) peer 1")}[case]  # P2POp names it
    assert note0.startswith(f"rank 0: {op} #2 on group {group} ({shape}) from ")
    assert f"tests/mmtrain/hang_worker.py:{skipped} " in note0
    assert note1.startswith("rank 1: all_gather #2 on group world (2 x (5,), (5,)) from "
                            f"tests/mmtrain/hang_worker.py:{waits} ")
    assert "imed out" in note0  # rank 1 fails at its own timeout or when rank 0 gives up (closed)
