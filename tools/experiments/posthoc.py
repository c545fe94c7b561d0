"""Measurements on each finished run's final checkpoint, added to its record (collapse.py --records).

Per run: the held-out eval on the whole val split (its mismatch gap, for runs trained before the
final eval measured it), the linear probe of the ViT features (mmtrain/evaluation/probe.py), the
caption words' accuracy with own vs swapped media per word class (tools/word_probe.py), and the
visual tokens' mean norm (against the text embeddings'). A record that already has them is
skipped, so a rerun only measures the new runs.

    python -m tools.experiments.posthoc --records docs/experiments/onset/runs --runs runs/onset
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mmtrain.data_pipelines.loader import build_loader
from mmtrain.errors import UserError, run_guarded
from mmtrain.evaluation.evaluate import evaluate
from mmtrain.evaluation.probe import probe_media, probe_scores
from mmtrain.inference.loading import load_model
from tools.word_probe import word_ids, word_stats


def measure(run_dir: Path, n_media: int) -> dict:
    """{"eval": EvalResult.to_dict(), "probe": {attr: ...}, "words": word_stats} of the newest checkpoint."""
    loaded = load_model(str(run_dir))
    cfg, tok, model = loaded.cfg, loaded.tokenizer, loaded.model
    cfg.data.num_workers = 0
    batches = list(build_loader(cfg.data, tok, "val"))
    out = {"eval": evaluate(model, batches, loaded.device).to_dict()}
    media = probe_media(cfg.data, tok, n_media)
    out["probe"] = probe_scores(model, media, loaded.device, model) if media else {}
    with torch.no_grad():
        model.eval()
        out["words"] = word_stats(model, batches, word_ids(tok), cfg.model.decoder.vocab_size)
        out["visual_norm"] = _visual_norm(model, batches)
        out["text_embed_norm"] = float(model.decoder.embed.weight.norm(dim=-1).mean())
    return out


def _visual_norm(model, batches) -> float | None:
    """Mean L2 norm of the visual tokens the decoder receives, over the val split's media."""
    norms = [model.vision(b.patches_NP, b.grid_thw_M3).norm(dim=-1)
             for b in batches if b.grid_thw_M3.shape[0]]
    return float(torch.cat(norms).mean()) if norms else None


def update(record_path: Path, run_dir: Path, n_media: int, force: bool) -> str:
    record = json.loads(record_path.read_text(encoding="utf-8"))
    if "posthoc" in record and not force:
        return "cached"
    if not (run_dir / "summary.json").exists():
        return "no run directory"
    record["posthoc"] = measure(run_dir, n_media)
    if not record.get("mismatch_end"):
        record["mismatch_end"] = record["posthoc"]["eval"]["mismatch_gap"]
        record["mismatch_end_from"] = "posthoc"  # the same final checkpoint, measured afterwards
    tmp = record_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(record_path)
    return "measured"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.experiments.posthoc",
                                description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, required=True,
                   help="RECORDS/ARM/seedN.json (collapse.py --records)")
    p.add_argument("--runs", type=Path, required=True, help="the experiment's --out: RUNS/ARM/seedN")
    p.add_argument("--media", type=int, default=100, help="val images for the linear probe (default 100)")
    p.add_argument("--force", action="store_true", help="measure again records that have it")
    args = p.parse_args(argv)
    return run_guarded(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    records = sorted(args.records.glob("*/seed*.json"))
    if not records:
        raise UserError(f"--records {args.records}: no ARM/seedN.json records")
    torch.set_num_threads(1)
    for path in records:
        run_dir = args.runs / path.parent.name / path.stem
        print(f"{path.parent.name:<16} {path.stem}: {update(path, run_dir, args.media, args.force)}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
