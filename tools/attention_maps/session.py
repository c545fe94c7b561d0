"""What one `mmtrain-attn` invocation does: load, build the document(s), analyse, render, report."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.errors import UserError
from mmtrain.evaluation.attribution import method_names
from mmtrain.inference.loading import Loaded, checkpoint_line, load_model
from mmtrain.inference.prompts import iter_val_samples, read_sample

from . import faith_report, plots
from .faithfulness import doc_words, evaluate
from .inputs import NoMediaError, doc_from_file, doc_from_sample, load_boxes
from .maps import DocAttention, analyze_document, parse_layers
from .metrics import Grounding, pointing_rows, scorable_words, token_records
from .render import DocPictures, layer_kinds, render_document, slug
from .report import write_report


@dataclass
class Session:
    args: object
    loaded: Loaded
    layers: list[int]
    heads: str | list[int]
    tokens: list[str] | None
    out: Path

    @classmethod
    def open(cls, args) -> Session:
        loaded = load_model(args.ckpt, args.device)
        dec = loaded.cfg.model.decoder
        try:
            layers = parse_layers(args.layers, dec.n_layers)
        except ValueError as e:
            raise UserError(f"--{e}") from None
        heads = parse_heads(args.heads, dec.n_heads)
        tokens = [t.strip().lower() for t in args.tokens.split(",") if t.strip()] if args.tokens else None
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            for stale in [*out.glob("maps/*.png"), *out.glob("maps/*.gif"), *out.glob("examples/*.png"),
                          *out.glob("examples/*.gif")]:  # pictures of an earlier run into the same OUT
                stale.unlink()
        except OSError as e:
            raise UserError(f"--out {out}: cannot create: {e.strerror or e}") from None
        return cls(args, loaded, layers, heads, tokens, out)

    # ----- pieces -----------------------------------------------------------------------------
    def analyze(self, doc, all_maps: bool) -> DocAttention:
        """all_maps: keep every row's map (to draw them); else only the rows the metrics need and
        the --tokens ones (memory: a kept row is heads x visual tokens floats)."""
        rows = None
        if not all_maps or self.tokens:
            rows = set(pointing_rows(doc))
            for p in range(len(doc)):
                piece, w = doc.token_strs[p].lower().strip(), doc.word_at(p)
                if self.tokens and (piece in self.tokens or (w is not None and w.text in self.tokens)):
                    rows |= {p, p - 1}
        return analyze_document(self.loaded.model, doc, self.layers, self.args.chunk, self.loaded.device,
                                None if rows is None else sorted(rows))

    def grounding(self) -> Grounding:
        dec = self.loaded.cfg.model.decoder
        return Grounding(self.layers, dec.n_heads, self.heads if isinstance(self.heads, list) else None)

    def base_metrics(self, mode: str) -> dict:
        dec = self.loaded.cfg.model.decoder
        return {"checkpoint": str(self.loaded.path), "command": self.command(), "mode": mode,
                "layers": self.layers,
                "layer_kinds": {str(l): "sparse" if dec.is_sparse(l) else "full" for l in self.layers},
                "n_heads": dec.n_heads, "heads": self.heads, "query": self.args.query}

    def command(self) -> str:
        return "mmtrain-attn " + shlex.join(getattr(self.args, "argv", []) or [])

    def figures(self, g: Grounding, att: DocAttention | None) -> list[tuple[str, Path]]:
        kinds = layer_kinds(att) if att is not None else {
            l: " S" if self.loaded.cfg.model.decoder.is_sparse(l) else " F" for l in self.layers}
        figs = []
        path = self.out / "mass_grid.png"
        plots.mass_grid(g.totals.means()["mass"], self.layers, kinds, path,
                        f"text→visual attention mass ({g.totals.rows} text rows)")
        figs.append(("Text → visual mass per layer and head", path))
        summary = g.to_dict()["pointing_game"]["token"]["summary"]
        if summary:
            path = self.out / "pointing.png"
            plots.pointing_chart(summary, self.layers, path)
            figs.append(("Pointing game per layer (token rows)", path))
        return figs

    @property
    def faith_on(self) -> bool:
        """--faithfulness, on by default for --from-val."""
        f = getattr(self.args, "faithfulness", None)
        return (self.args.from_val is not None) if f is None else f

    def faithfulness(self, words, examples) -> tuple[dict, list[tuple[str, Path]]]:
        """Knock out every scored word (and with --sanity randomise the weights); the curves figure,
        and each rendered example word's own curves beside its maps."""
        if not words:
            return {"words": 0, "note": "no word names a boxed object: nothing to knock out"}, []
        faith = evaluate(self.loaded.model, words, self.args.draws)
        if self.args.sanity:
            from .sanity import sanity

            heads = [tuple(int(x) for x in h[1:].split("H")) for h in faith["heads"]]
            methods = method_names(self.loaded.cfg.model.decoder.n_layers)
            faith["sanity"] = sanity(self.loaded.model, words, methods, heads)
        for _, pics, _, _, doc in examples:
            for sw in (w for w in words if w.doc == doc.name and w.curves is not None):
                path = self.out / "examples" / f"{slug(doc.name)}_t{sw.span.start:04d}_curves.png"
                pics.curves[sw.span.start] = faith_report.word_figure(sw, faith["default"], path)
        path = faith_report.curves_figure(faith, self.out / "faithfulness.png")
        return faith, [("Knockout faithfulness: deletion and insertion curves", path)]

    def _write(self, metrics: dict, title: str, intro: str, figures, documents) -> Path:
        (self.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
        report = self.out / "report.html"
        write_report(report, title, intro, metrics, figures, documents)
        return report

    # ----- modes ------------------------------------------------------------------------------
    def single_doc(self):
        a, L = self.args, self.loaded
        objects = load_boxes(a.boxes) if a.boxes else None
        if a.image or a.video:
            kind = "image" if a.image else "video"
            return doc_from_file(a.image or a.video, kind, a.text, L.tokenizer, L.cfg.data, objects)
        raw = read_sample(a.shard, a.key)
        try:
            return doc_from_sample(raw, L.tokenizer, L.cfg.data, a.text, objects)
        except SkipSample as e:
            raise UserError(f"{a.shard} {a.key}: unreadable sample: {e}") from None

    def run_single(self) -> list[str]:
        doc = self.single_doc()
        att = self.analyze(doc, all_maps=True)
        g = self.grounding()
        trials = g.add(att)
        pics = render_document(att, self.out / "maps", self.heads, self.tokens, self.args.query)
        metrics = {**self.base_metrics("single"), "input": _doc_summary(doc), **g.to_dict(per_token=True),
                   "tokens": token_records(att)}
        faith_figs = []
        if self.faith_on:
            words = doc_words(self.loaded.model, doc, self.loaded.device)
            metrics["faithfulness"], faith_figs = self.faithfulness(words, [(att, pics, None, "", doc)])
        intro = (f"<p>Checkpoint <code>{self.loaded.path}</code>; <code>{self.command()}</code>. "
                 f"{_describe(doc)}</p>")
        report = self._write(metrics, f"Attention maps: {doc.name}", intro, self.figures(g, att) + faith_figs,
                             [(att, pics, trials[self.args.query], f"{doc.kind}: {doc.name}")])
        return [checkpoint_line(self.args.ckpt, self.loaded.path),
                f"{doc.kind} {doc.name}: {len(doc)} tokens, {len(pics.tokens)} token maps",
                *_headline_lines(metrics), *_faith_lines(metrics), f"report: {report}",
                f"metrics: {self.out / 'metrics.json'}"]

    def run_val(self) -> list[str]:
        L, n_want = self.loaded, self.args.from_val
        g = self.grounding()
        skipped: Counter = Counter()
        examples: list[tuple[DocAttention, DocPictures, list, str]] = []
        example_docs, scored = [], []
        used = 0
        for source, raw in iter_val_samples(L.cfg.data):
            if used >= n_want:
                break
            try:
                doc = doc_from_sample(raw, L.tokenizer, L.cfg.data)
            except NoMediaError:
                continue  # text-only: nothing to look at, not counted
            except (SkipSample, UserError) as e:
                skipped[getattr(e, "reason", "too_long")] += 1
                continue
            example = len(examples) < self.args.examples
            att = self.analyze(doc, all_maps=example)
            trials = g.add(att)
            used += 1
            if self.faith_on:
                scored += doc_words(L.model, doc, L.device)
            if example:
                # Examples draw the words that name a boxed object unless --tokens says otherwise.
                words = self.tokens or sorted({w.text for w, _, _ in scorable_words(doc)}) or None
                pics = render_document(att, self.out / "examples", self.heads, words, self.args.query,
                                       prefix=f"{len(examples)}_")
                examples.append((att, pics, trials[self.args.query], f"example {len(examples) + 1}: "
                                 f"{doc.kind} {doc.name} ({source})"))
                example_docs.append((att, pics, None, "", doc))
        if used == 0:
            raise UserError(f"{self.loaded.path}: the val split has no readable sample with media")
        metrics = {**self.base_metrics("from_val"),
                   "samples": {"requested": n_want, "used": used, "by_kind": dict(g.kinds),
                               "skipped": dict(skipped)}, **g.to_dict()}
        faith_figs = []
        if self.faith_on:
            metrics["faithfulness"], faith_figs = self.faithfulness(scored, example_docs)
        intro = (f"<p>Checkpoint <code>{self.loaded.path}</code>; <code>{self.command()}</code>. "
                 f"{used} held-out documents with media ({', '.join(f'{v} {k}' for k, v in g.kinds.items())})"
                 ", "
                 f"round-robin over the val sources; {len(examples)} rendered below.</p>")
        report = self._write(metrics, f"Attention maps over {used} val documents", intro,
                             self.figures(g, examples[0][0] if examples else None) + faith_figs, examples)
        return [checkpoint_line(self.args.ckpt, self.loaded.path), f"{used} val documents ({dict(g.kinds)})",
                *_headline_lines(metrics), *_faith_lines(metrics),
                f"report: {report}", f"metrics: {self.out / 'metrics.json'}"]


def parse_heads(spec: str, n_heads: int) -> str | list[int]:
    """--heads: "mean", "all", or distinct head indices (negative: from the end)."""
    if spec in ("mean", "all"):
        return spec
    bad = UserError(f"--heads: mean, all, or head indices in [0, {n_heads}) (got {spec!r})")
    try:
        heads = [int(x) for x in spec.split(",")]
    except ValueError:
        raise bad from None
    if not heads or any(not -n_heads <= h < n_heads for h in heads):
        raise bad
    return sorted({h % n_heads for h in heads})


def _doc_summary(doc) -> dict:
    return {"name": doc.name, "kind": doc.kind, "tokens": len(doc),
            "media": [{"kind": m.kind_name, "grid_thw": list(m.grid_thw), "resized_hw": list(m.resized_hw),
                       "orig_hw": list(m.orig_hw), "objects": len(m.objects)} for m in doc.media]}


def _describe(doc) -> str:
    media = ", ".join(f"{m.kind_name} {m.orig_hw[1]}×{m.orig_hw[0]} px → "
                      f"{'×'.join(map(str, m.grid_thw))} tokens" for m in doc.media)
    return f"{doc.kind} document of {len(doc)} tokens; media: {media}."


def _headline_lines(metrics: dict) -> list[str]:
    attn = metrics["attention"]["mass"]["per_layer"]
    lines = ["text->visual mass per layer: " + ", ".join(f"L{l} {v:.3f}" for l, v in attn.items())]
    for cat, h in metrics["headline"].items():
        lines.append(f"pointing {cat}: {h['accuracy']:.3f} (mean map over layers; best L{h['best_layer']} "
                     f"{h['best_layer_accuracy']:.3f}) vs chance {h['chance']:.3f} box / "
                     f"{h['chance_cell']:.3f} random token, n={h['n']}")
    return lines


def _faith_lines(metrics: dict) -> list[str]:
    f = metrics.get("faithfulness")
    if not f or not f.get("words"):
        return [f"faithfulness: {f['note']}"] if f else []
    lines = []
    for k in dict.fromkeys([f["default"], f["best"]]):
        m = f["methods"][k]
        lo, hi = m["deletion_ratio_95"]
        tag = " (default)" if k == f["default"] else " (best)"
        lines.append(f"faithfulness {k}{tag}: deletion AUC {m['deletion_auc']:.3f} nats = "
                     f"{m['deletion_ratio']:.2f}x random [95% {lo:.2f}, {hi:.2f}] (random "
                     f"{f['random']['deletion_auc']:.3f}, z {m['deletion_z']:.1f}), {m['oracle_ratio']:.2f}x "
                     f"box oracle, insertion@20% {m['insertion_20']:.2f} of the medium's worth; "
                     f"{f['words']} words")
    if "sanity" in f:
        lines.append("sanity (Spearman >= 0.3 after randomisation): " + (", ".join(f["sanity"]["flagged"]) or
                                                                         "no method flagged"))
    return lines
