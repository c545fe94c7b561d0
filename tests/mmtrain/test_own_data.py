"""A new user's own data, end to end, as the README's "Train on your own data" does it: a JSONL of
images and captions made here -> `data write` -> `data config` (a tokenizer trained on the shards,
over configs/tiny.yaml) -> `train` with stdout piped -> `generate`. Nothing of the built-in corpus."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import yaml
from PIL import Image

from mmtrain.cli import main
from mmtrain.data_pipelines.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
SMALL = ["train.steps=6", "train.log_every=2", "train.ckpt_every=0", "train.eval_batches=2",
         "data.num_workers=0", "data.batch_size=2", "model.vision.dim=32", "model.vision.depth=1",
         "model.vision.n_heads=2", "model.decoder.dim=32", "model.decoder.n_layers=2",
         "model.decoder.n_heads=2", "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64",
         "model.decoder.mrope_sections=[2, 3, 3]", "model.decoder.moe.n_routed=4",
         "model.decoder.moe.expert_dim=32"]


def _photos(root) -> None:
    """root/pics.jsonl: 48 solid-colour pictures captioned by their colour, 16 text notes, mixed."""
    rng, lines = random.Random(0), []
    for i in range(48):
        colour = rng.choice(list(COLOURS))
        Image.new("RGB", rng.choice([(48, 40), (40, 32), (64, 48)]), COLOURS[colour]).save(root / f"p{i}.png")
        lines.append({"image": f"p{i}.png", "text": f"a photo that is entirely {colour}."})
    lines += [{"text": f"note {i}: the colours are red, green, blue and yellow."} for i in range(16)]
    rng.shuffle(lines)
    (root / "pics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_own_data_in_three_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _photos(tmp_path)
    assert main(["data", "write", "--from", "jsonl", "pics.jsonl", "--out", "shards",
                 "--shard-size", "16"]) == 0
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    assert main(["data", "config", "photos=shards/*.tar", "--base", tiny, "--out", "my.yaml"]) == 0
    capsys.readouterr()
    raw = yaml.safe_load((tmp_path / "my.yaml").read_text())
    assert raw["data"]["val"] == [{"name": "photos", "shards": ["shards/shard-000003.tar"]}]
    assert raw["data"]["train"][0]["shards"] == ["shards/shard-{000000..000002}.tar"]

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "mmtrain.cli", "train", "my.yaml",
                           *(f"--set={s}" for s in SMALL)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout  # piped: no terminal, as under SLURM or tee
    row = next(line for line in out.splitlines() if re.match(r"\W*image_text ", line))
    assert len(re.findall(r"[+-]\d+\.\d{3}\b", row)) == 4 and "…" not in out, row  # gaps whole
    assert re.search(r"step 6/6 .*\| w txt \d\.\d\d img \d\.\d\d vid \d\.\d\d \|", out)

    resolved = (tmp_path / "runs" / "my" / "config.yaml").read_text()
    assert "shapes" not in resolved
    tok = load_tokenizer(tmp_path / "my.tokenizer.json")
    assert len(tok.encode(" entirely")) == 1  # learnt from these captions
    assert yaml.safe_load(resolved)["model"]["decoder"]["vocab_size"] == tok.vocab_size
    assert main(["generate", "--ckpt", "runs/my", "--image", "p0.png", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()
