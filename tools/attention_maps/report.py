"""The self-contained HTML report: summary tables and figures, then each rendered document with its
tokens (each token with maps links to them) and the maps themselves, all images inlined as base64."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from . import faith_report
from .maps import DocAttention
from .metrics import Trial
from .render import DocPictures

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;max-width:1400px;color:#222}
h1{font-size:20px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:2px 7px;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.toks{line-height:2.1;font-family:ui-monospace,monospace;font-size:13px}
.tok{padding:1px 3px;margin:0 1px;border-radius:3px;border:1px solid #e4e4e4;white-space:pre}
a.tok{color:#0645ad;text-decoration:none;border-color:#9bb}.sp{color:#999;font-size:11px}
.med{background:#dfe9f7;border:1px solid #9ab;padding:1px 5px;border-radius:3px;font-size:12px}
.tsec{border-top:1px dashed #ccc;padding-top:6px;margin-top:10px}.note{color:#555;font-size:12.5px}
img{max-width:100%;image-rendering:pixelated;margin:4px 4px 4px 0;vertical-align:top}
.hit{color:#18873a;font-weight:600}.miss{color:#b0302a;font-weight:600}
"""


def _img(path: Path) -> str:
    mime = "image/gif" if path.suffix == ".gif" else "image/png"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:{mime};base64,{data}">'


def _f(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def attention_table(attn: dict, layers: list[int], kinds: dict[int, str]) -> str:
    rows = "".join(
        f"<tr><td>L{l}{kinds.get(l, '')}</td><td>{_f(attn['mass']['per_layer'][str(l)])}</td>"
        f"<td>{_f(attn['entropy']['per_layer'][str(l)])}</td><td>{_f(attn['sink']['per_layer'][str(l)])}</td></tr>"
        for l in layers)
    return ("<table><tr><th>layer</th><th>text→visual mass</th><th>entropy (nats)</th><th>sink mass</th></tr>"
            f"{rows}</table><p class=note>means over {attn['rows']} text rows (head mean); "
            "F full attention, S sparse.</p>")


def pointing_table(summary: dict, layers: list[int]) -> str:
    if not summary:
        return "<p class=note>No word named a boxed object: no pointing game.</p>"
    head = "".join(f"<th>L{l}</th>" for l in layers)
    out = [f"<table><tr><th>words</th><th>n</th>{head}<th>mean map</th><th>chance (box share)</th>"
           "<th>chance (random token)</th><th>n multi</th><th>named obj. (multi)</th>"
           "<th>other obj. (multi)</th></tr>"]
    for key, s in summary.items():
        accs = "".join(f"<td>{_f(s['accuracy'][str(l)])}</td>" for l in layers)
        multi, other = s.get("accuracy_multi"), s.get("accuracy_other")
        out.append(f"<tr><td>{html.escape(key)}</td><td>{s['n']}</td>{accs}<td><b>{_f(s['accuracy_mean_layers'])}</b>"
                   f"</td><td>{_f(s['chance'])}</td><td>{_f(s['chance_cell'])}</td><td>{s['n_multi']}</td>"
                   f"<td>{_f(multi and multi['mean'])}</td><td>{_f(other and other['mean'])}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _token_strip(att: DocAttention, pics: DocPictures, did: str) -> str:
    doc = att.doc
    mass = {int(p): float(sum(att.per_layer[l].mass_HR[:, i].mean() for l in att.layers) / len(att.layers))
            for i, p in enumerate(att.rows)}
    starts = {m.start: m for m in doc.media}
    out, pos = [], 0
    while pos < len(doc):
        if pos in starts:
            m = starts[pos]
            grid = "×".join(str(x) for x in (m.grid_thw if m.kind_name == "video" else m.grid_thw[1:]))
            label = f"{m.kind_name} {m.index + 1}: {grid} tokens"
            out.append(f'<a class=med href="#{did}-m{m.index}">{label}</a>')
            pos += m.n_tokens
            continue
        text = html.escape(doc.token_strs[pos])
        if doc.special_L[pos]:
            out.append(f"<span class='tok sp'>{text}</span>")
        else:
            a = min(mass.get(pos, 0.0), 1.0)
            style = f' style="background:rgba(255,140,0,{a:.2f})"'
            tip = f' title="text→visual mass {a:.3f} (mean over layers and heads)"' if pos in mass else ""
            if pos in pics.tokens:
                out.append(f'<a class=tok href="#{did}-t{pos}"{style}{tip}>{text}</a>')
            else:
                out.append(f"<span class=tok{style}{tip}>{text}</span>")
        pos += 1
    return "<div class=toks>" + " ".join(out) + "</div>"


def _trial_line(t: Trial) -> str:
    hits = " ".join(f"<span class={'hit' if t.accuracy(k) >= 0.5 else 'miss'}>"
                    f"{'L' + k if k != 'mean' else 'mean'} {t.accuracy(k):.2f}</span>" for k in t.hits)
    return (f"<p>names object {t.object + 1} ({t.category}); pointing ({t.query} rows, fraction of "
            f"slices hit): {hits}; chance {t.chance:.3f} (box) / {t.chance_cell:.3f} (random token)</p>")


def document_section(att: DocAttention, pics: DocPictures, trials: list[Trial], did: str, title: str) -> str:
    doc = att.doc
    by_pos = {p: t for t in trials for p in range(t.start, t.end)}
    out = [f"<h2 id='{did}'>{html.escape(title)}</h2>"]
    for m, path in zip(doc.media, pics.media):
        out.append(f"<div id='{did}-m{m.index}'><h3>{m.kind_name} {m.index + 1}</h3>{_img(path)}"
                   f"<p class=note>source {m.orig_hw[1]}×{m.orig_hw[0]} px, resized to {m.resized_hw[1]}×"
                   f"{m.resized_hw[0]}, merged token grid t×h×w = {'×'.join(map(str, m.grid_thw))}; "
                   f"{len(m.objects)} boxed object(s)</p></div>")
    for l, path in pics.blocks.items():
        out.append(f"<h3>Sparse block selection, layer {l}</h3>{_img(path)}")
    for pos, tp in pics.tokens.items():
        mass = ", ".join(f"L{l} {v:.3f}" for l, v in tp.mass.items())
        out.append(f"<div class=tsec id='{did}-t{pos}'><h3>'{html.escape(doc.token_strs[pos])}' "
                   f"(token {pos}) → {doc.media[tp.medium].kind_name} {tp.medium + 1}</h3>"
                   f"<p>mass on this medium (head mean): {mass}</p>")
        if pos in by_pos:
            out.append(_trial_line(by_pos[pos]))
        out.extend(_img(f) for f in tp.files)
        if pos in pics.curves:  # the knockout test of this word's map, beside it
            out.append(_img(pics.curves[pos]))
        out.append("</div>")
    return "".join(out)


def write_report(path: Path, title: str, intro: str, metrics: dict, figures: list[tuple[str, Path]],
                 documents: list[tuple[DocAttention, DocPictures, list[Trial], str]]) -> None:
    layers = metrics["layers"]
    kinds = {int(k): v for k, v in metrics["layer_kinds"].items()}
    pg = metrics["pointing_game"]
    body = [f"<h1>{html.escape(title)}</h1>", intro, "<h2>Text → visual attention</h2>",
            attention_table(metrics["attention"], layers, {l: f" {kinds[l][0].upper()}" for l in kinds}),
            "<h2>Pointing game</h2><p class=note>Token rows: where the word itself looks. A hit: the argmax "
            "token's pixel rectangle touches the named object's box. The random-token chance is the "
            "honest baseline on a coarse token grid; “other obj.” scores the same argmax against the "
            "other objects of the same medium (salience, not grounding, if it matches the named one).</p>",
            pointing_table(pg["token"]["summary"], layers),
            "<h3>Predictor rows (the row that predicts the word)</h3>",
            pointing_table(pg["predictor"]["summary"], layers)]
    if "faithfulness" in metrics:
        faith = metrics["faithfulness"]
        body += ["<h2 id=faithfulness>Knockout faithfulness</h2><p class=note>Each method's map ranks the "
                 "medium's visual tokens for a word (its predictor rows); the top k% are masked as keys for "
                 "every query in every layer and the word's log-probability drop is measured, against "
                 "random orders and the box oracle; insertion masks the whole medium and restores the top "
                 "k%. Default method: "
                 f"<b>{html.escape(faith['default'])}</b>; most faithful here: "
                 f"{html.escape(faith['best'])}.</p>",
                 faith_report.table(faith), faith_report.video_note(faith)]
    for caption, fig in figures:
        body.append(f"<h3>{html.escape(caption)}</h3>{_img(fig)}")
    strips = [f"<h3><a href='#d{i}'>{html.escape(t)}</a></h3>{_token_strip(att, pics, f'd{i}')}"
              for i, (att, pics, _, t) in enumerate(documents)]
    if strips:
        body[2:2] = ["<h2>Tokens</h2><p class=note>Shaded by text→visual attention mass (mean over layers "
                     "and heads); linked tokens have maps below; a medium chip links to its frames.</p>",
                     *strips]
    for i, (att, pics, trials, t) in enumerate(documents):
        body.append(document_section(att, pics, trials, f"d{i}", t))
    page = (f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>")
    path.write_text(page, encoding="utf-8")
