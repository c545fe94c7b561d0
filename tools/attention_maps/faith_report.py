"""Knockout faithfulness in the report: the curves (matplotlib) and the table of methods (HTML)."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from mmtrain.evaluation.knockout import FRACS

from .faithfulness import ORACLE, ScoredWord

X = [0.0, *(100 * f for f in FRACS)]  # % of the medium's tokens knocked out


def _axes(n: int, width: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, n, figsize=(width * n, 3.2))


def curves_figure(faith: dict, path: Path, top: int = 4) -> Path:
    """Mean deletion drop and insertion gain against % knocked out: the default method, the best
    others, random orders (mean, 95% band over draws) and the box oracle."""
    plt, fig, (ax_d, ax_i) = _axes(2)
    ms = faith["methods"]
    named = [faith["default"]] + [k for k in sorted(ms, key=lambda k: -ms[k]["deletion_z"])
                                  if k not in (faith["default"], ORACLE)][:top - 1]
    rnd = faith["random"]
    lo, hi = rnd["deletion_curve_95"]
    ax_d.fill_between(X, [0, *lo], [0, *hi], color="0.85", label="random 95%")
    ax_d.plot(X, [0, *rnd["deletion_curve"]], color="0.4", ls="--", label="random")
    for k in [*named, ORACLE]:
        style = {"lw": 2.4} if k == faith["default"] else {"ls": ":" if k == ORACLE else "-"}
        ax_d.plot(X, [0, *ms[k]["deletion_curve"]], marker="o", ms=3, label=k, **style)
        ax_i.plot(X, [0, *ms[k]["insertion_curve"]], marker="o", ms=3, label=k, **style)
    ax_i.axhline(faith["medium_gap"], color="0.4", ls="--", label="whole medium")
    ax_d.set(title=f"deletion ({faith['words']} words)", xlabel="% of visual keys knocked out (top first)",
             ylabel="drop in log p(word) (nats)")
    ax_i.set(title="insertion (all masked, top restored)", xlabel="% of visual keys kept (top first)",
             ylabel="gain in log p(word) over all masked")
    ax_d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def word_figure(sw: ScoredWord, method: str, path: Path) -> Path:
    """One word's deletion curve by `method` against its random draws and the box oracle."""
    c = sw.curves
    plt, fig, ax = _axes(1, 3.6)
    drop_NF = c.full - c.random_del
    lo, hi = np.percentile(drop_NF, [2.5, 97.5], axis=0)
    ax.fill_between(X, [0, *lo], [0, *hi], color="0.85", label="random 95%")
    ax.plot(X, [0, *(c.full - c.deletion[method])], marker="o", lw=2.2, label=method)
    ax.plot(X, [0, *(c.full - c.deletion[ORACLE])], marker="o", ls=":", label=ORACLE)
    ax.set(title=f"'{sw.word}': knockout (log p {c.full:.2f}, all masked {c.empty:.2f})",
           xlabel="% of visual keys knocked out", ylabel="drop in log p (nats)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _f(x, nd: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{nd}f}"


def table(faith: dict) -> str:
    """The methods: deletion AUC and its ratios, insertion, and the sanity check's correlations."""
    san = faith.get("sanity", {}).get("stages", {})
    flagged = set(faith.get("sanity", {}).get("flagged", []))
    head = "".join(f"<th>Spearman after: {html.escape(s)}</th>" for s in san)
    rows = []
    for k, m in faith["methods"].items():
        lo, hi = m["deletion_ratio_95"]
        name = f"<b>{html.escape(k)}</b> (default)" if k == faith["default"] else html.escape(k)
        rho = "".join(f"<td>{_f(r.get(k))}{' ⚑' if k in flagged and (r.get(k) or 0) >= 0.3 else ''}</td>"
                      for r in san.values())
        rows.append(f"<tr><td>{name}</td><td>{_f(m['deletion_auc'], 3)}</td><td>{_f(m['deletion_ratio'])} "
                    f"[{_f(lo)}, {_f(hi)}]</td><td>{_f(m['deletion_z'], 1)}</td>"
                    f"<td>{_f(m['oracle_ratio'])}</td>"
                    f"<td>{_f(m['insertion_20'])}</td>"
                    f"<td>{_f(m['insertion_auc'])}</td>{rho}</tr>")
    r = faith["random"]
    return ("<table><tr><th>method</th><th>deletion AUC (nats)</th><th>÷ random [95%]</th><th>z</th>"
            "<th>÷ box oracle</th>"
            f"<th>insertion @20%</th><th>insertion AUC</th>{head}</tr>{''.join(rows)}</table>"
            f"<p class=note>{faith['words']} words, {faith['draws']} random orders a word: random "
            "deletion AUC "
            f"{_f(r['deletion_auc'], 3)} (95% over draws {_f(r['deletion_auc_95'][0], 3)}–"
            f"{_f(r['deletion_auc_95'][1], 3)}); the whole medium is worth {_f(faith['medium_gap'], 3)} "
            "nats a "
            f"word. Insertion: share of that recovered with only the top tokens kept. ⚑: Spearman ≥ 0.3 with "
            f"the trained maps after randomisation (the map survives it). Localisation heads: "
            f"{', '.join(faith.get('heads', []))}.</p>")


def video_note(faith: dict) -> str:
    v = faith.get("video") or {}
    if not v.get("words"):
        return ""
    lines = "".join(f"<li>{html.escape(w['doc'])} '{html.escape(w['word'])}': relied on slice "
                    f"{w['relied_slice']} (frames {w['relied_frames']}), drops per slice "
                    f"{', '.join(_f(x) for x in w['slice_drop'])}; map's share per slice "
                    f"{', '.join(_f(x) for x in w['map_slice_share'])}</li>" for w in v["per_word"][:12])
    return (f"<h3>Video: which frames the word relied on</h3><p class=note>One temporal slice knocked out at "
            f"a time; the map's top slice is the knockout's in {_f(v['map_top_slice_agrees'])} of "
            f"{v['words']} words.</p><ul>{lines}</ul>")
