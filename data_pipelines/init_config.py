"""`mmtrain data config SPEC... --out my.yaml`: a short run config for your shards over a recipe.

    mmtrain data config 'shards/*.tar' --out my.yaml                 # tiny, tokenizer trained
    mmtrain data config photos='img/*.tar' notes=text.tar --base small --val 'val/*.tar' \\
        --tokenizer tok.json --out my.yaml

The file says `base: configs/<base>.yaml` (`mmtrain/config.py` merges it under the file: every key
not set here comes from the recipe) and sets only the data that is yours: one train source per
SPEC (NAME=SPEC names it; else the kind its first samples share), val sources (given with --val,
else the last --val-shards shards of every source, held out of train), the tokenizer (a
tokenizer.json or 'byte', else one trained here on the train sources' text) and the media
settings the shards' headers call for (a video frame rate no higher than the clips'), with what
was measured as comments.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import yaml

from mmtrain.data_pipelines.config import MediaConfig
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.preprocess import plan_size
from mmtrain.data_pipelines.scan import Scan, compact, scan_source
from mmtrain.data_pipelines.shards import expand_spec
from mmtrain.data_pipelines.train_tokenizer import add_sample_arguments, train_from

RECIPES = ("tiny", "small", "base", "long")
_NAMED = re.compile(r"^([A-Za-z_][\w-]*)=(.+)$")
_TINY_VOCAB = 4096  # the tiny model's embedding stays small; the others use --vocab-size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="[NAME=]SPEC",
                   help="one train source per shard spec (paths, globs, brace ranges, dirs)")
    p.add_argument("--out", required=True, help="the config YAML to write")
    p.add_argument("--base", default="tiny", help=f"the recipe: {', '.join(RECIPES)} or a config path "
                                                  "(default tiny: 2 CPU cores)")
    p.add_argument("--val", nargs="+", metavar="[NAME=]SPEC", help="val sources (default: held out)")
    p.add_argument("--val-shards", type=int, default=1,
                   help="without --val: the last N shards of every source are val (default 1)")
    p.add_argument("--tokenizer", help="a tokenizer.json or 'byte' (default: train one on the train "
                                       "sources into OUT's folder as <out stem>.tokenizer.json)")
    p.add_argument("--run-dir", help="the run directory (default runs/<out stem>)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--scan", type=int, default=200, help="samples per source read for kinds and media "
                                                         "sizes (default 200)")
    add_sample_arguments(p)
    p.set_defaults(vocab_size=None)


def recipe_path(base: str) -> Path:
    """A recipe name -> configs/<name>.yaml (here, else the checkout's); anything else is a path."""
    if base not in RECIPES:
        path = Path(base)
    else:
        here, checkout = Path("configs"), Path(__file__).resolve().parents[1] / "configs"
        path = next((d / f"{base}.yaml" for d in (here, checkout) if (d / f"{base}.yaml").is_file()),
                    here / f"{base}.yaml")
    if not path.is_file():
        raise DataError(f"--base {base}: config not found: {path}")
    return path


def parse_sources(specs: list[str]) -> list[tuple[str | None, str, list[str]]]:
    """[NAME=]SPEC -> (name or None, spec, shard paths); a spec matching nothing is a DataError."""
    out = []
    for item in specs:
        m = _NAMED.match(item)
        name, spec = (m.group(1), m.group(2)) if m and not os.path.exists(item) else (None, item)
        out.append((name, spec, expand_spec(spec)))
    return out


def _names(scans: list[Scan], given: list[str | None]) -> list[str]:
    names, seen = [], set()
    for scan, name in zip(scans, given):
        name = name or scan.name()
        base, i = name, 2
        while name in seen:
            name, i = f"{base}{i}", i + 1
        seen.add(name)
        names.append(name)
    return names


def split(sources, val_shards: int) -> list[tuple[list[str], list[str]]]:
    """(train specs, val specs) per source: its last `val_shards` shards held out."""
    if val_shards < 1:
        raise DataError(f"--val-shards: must be >= 1 (got {val_shards})")
    out = []
    for _, spec, urls in sources:
        if len(urls) <= val_shards:
            raise DataError(f"{spec}: {len(urls)} shard(s), nothing left to train on after holding out "
                            f"{val_shards} for val: give --val SPEC, or write smaller shards "
                            "(mmtrain data write --shard-size)")
        out.append((compact(urls[:-val_shards]), compact(urls[-val_shards:])))
    return out


def media_edits(scans: list[Scan], media: dict) -> tuple[dict, str]:
    """Media settings the shards call for, and a comment saying what was measured."""
    images = [hw for s in scans for hw in s.image_px]
    videos = [v for s in scans for v in s.video]
    notes, edits = [], {}
    if images:
        areas = sorted(h * w for h, w in images)
        h, w = max(images, key=lambda hw: hw[0] * hw[1])
        try:
            cfg = MediaConfig(**{k: v for k, v in media.items() if k in MediaConfig.__dataclass_fields__})
        except (TypeError, ValueError) as e:
            raise DataError(f"--base: data.media: {e}") from None
        H, W = plan_size(h, w, cfg)
        notes.append(f"{len(images)} images, median {areas[len(areas) // 2]:,} px, largest {w}x{h} "
                     f"({H // cfg.factor * W // cfg.factor} visual tokens at max_pixels {cfg.max_pixels})")
    fps = [s.median_fps() for s in scans if s.median_fps()]
    if videos and fps:
        notes.append(f"{len(videos)} videos at {min(fps):g} fps (median of the slowest source)")
        if min(fps) < media.get("video_fps", 2.0):  # sampling faster than the clips repeats frames
            edits["video_fps"] = float(min(fps))
    return edits, "; ".join(notes)


def _flow(value) -> str:
    """One YAML value on one line (a scalar without the document end marker safe_dump adds)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _relative(path: Path, start: Path) -> str:
    """`path` as the config names it (relative to its folder): relative when close by, else absolute."""
    rel = os.path.relpath(path.resolve(), start.resolve())
    return rel if not rel.startswith(os.path.join("..", "..")) else str(path.resolve())


def _sources_yaml(names, specs, notes: list[str], weights: bool) -> list[str]:
    lines = []
    for name, shards, note in zip(names, specs, notes):
        item = {"name": name, "shards": shards, **({"weight": 1.0} if weights else {})}
        lines.append(f"    - {_flow(item)}" + (f"  # {note}" if note else ""))
    return lines


def render(base: Path, out: Path, run_dir: str, tokenizer: str, tok_note: str, train, val, val_note: str,
           media: dict, media_note: str) -> str:
    """train/val: (names, specs, notes). The config text, with comments saying where values came from."""
    lines = [
        "# Written by `mmtrain data config`: your data over the base config below, whose every key",
        f"# not set here stays as it is. Train: mmtrain train {out}",
        f"base: {_flow(_relative(base, out.parent))}",
        f"run_dir: {_flow(run_dir)}",
        "data:",
        f"  tokenizer: {_flow(tokenizer)}" + (f"  # {tok_note}" if tok_note else ""),
        "  train:  # weight: a source's relative share of the documents drawn",
        *_sources_yaml(*train, weights=True),
        f"  val:  # {val_note}",
        *_sources_yaml(*val, [""] * len(val[0]), weights=False),
    ]
    if media or media_note:
        note = f"  # measured: {media_note}" if media_note else ""
        lines.append(f"  media:{note}" if media else f"  media: {{}}{note}")
        lines += [f"    {k}: {_flow(v)}" for k, v in media.items()]
    return "\n".join(lines) + "\n"


def _tokenizer(args, out: Path, train_specs: list[str], base: Path) -> tuple[str, str]:
    if args.tokenizer:
        return args.tokenizer, ""
    vocab = args.vocab_size or (_TINY_VOCAB if base.stem == "tiny" else 32000)
    path = out.with_name(f"{out.stem}.tokenizer.json")
    tok, counts = train_from(train_specs, path, vocab, args.max_docs, args.max_bytes)
    return str(path), f"trained here: {tok.vocab_size} tokens from {counts['docs']:,} train documents"


def _train_and_val(args, sources, names: list[str]):
    """-> train specs per source, (val names, val specs), and a note saying where val came from."""
    if not args.val:
        parts = split(sources, args.val_shards)
        note = f"the last {args.val_shards} shard(s) of each source, held out of train"
        return [t for t, _ in parts], (names, [v for _, v in parts]), note
    given = parse_sources(args.val)
    val_names = _names([scan_source(urls, args.scan) for _, _, urls in given], [n for n, _, _ in given])
    val = (val_names, [[spec] for _, spec, _ in given])
    return [[spec] for _, spec, _ in sources], val, "given with --val"


def _recipe_media(base: Path) -> dict:
    try:
        recipe = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"--base {base}: cannot read it ({str(e).splitlines()[0]})") from None
    data = recipe.get("data") if isinstance(recipe, dict) else None
    return (data.get("media") if isinstance(data, dict) else None) or {}


def run(args: argparse.Namespace) -> int:
    out, base = Path(args.out), recipe_path(args.base)
    if out.exists() and not args.force:
        raise DataError(f"--out {out}: exists (your edits?); pass --force to replace it")
    sources = parse_sources(args.sources)
    scans = [scan_source(urls, args.scan) for _, _, urls in sources]
    names = _names(scans, [name for name, _, _ in sources])
    train_specs, val, val_note = _train_and_val(args, sources, names)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_note = _tokenizer(args, out, [s for specs in train_specs for s in specs], base)
    media, media_note = media_edits(scans, _recipe_media(base))
    text = render(base, out, args.run_dir or f"runs/{out.stem}", tokenizer, tok_note,
                  (names, train_specs, [s.describe() for s in scans]), val, val_note, media, media_note)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} over {base}: {len(names)} train source(s) ({', '.join(names)}), tokenizer "
          f"{tokenizer}\ntrain it: mmtrain train {out}")
    return 0
