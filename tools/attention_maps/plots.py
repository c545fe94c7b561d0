"""Pictures: per-token heatmaps over images and video frames (Pillow), and summary figures (matplotlib).

Frames and heatmaps are nearest-upsampled (the pixels the model saw and one square per merged
visual token: no invented detail). A map is drawn in a perceptual colour map (inferno), each panel
normalised to its own maximum, over the frame with an opacity that grows with the value, so tokens
the row ignores leave the picture visible instead of darkening it. The panel's title gives the
probability mass the row puts on that medium, so a bright but tiny map is not mistaken for strong
attention. Green boxes, labelled: the object the word names (the target; every object in the
"what the model saw" strip); cyan square: the argmax token (the pointing-game guess).

A box is [x0, y0, x1, y1] in original pixels, or (box, label).

Legend: t/h/w merged token grid, H/W pixels, L layers, G selection heads, Q/N query/key blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .inputs import MediumInfo
from .metrics import cell_rects

PANEL = 224  # px of a panel's longer side
TITLE = 16  # px of a panel's title strip
ALPHA = (0.12, 0.8)  # heatmap opacity at the panel's zero and at its maximum
BOX = (60, 230, 90)
ARGMAX = (40, 220, 255)


def _lut(name: str = "inferno") -> np.ndarray:
    import matplotlib

    return (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)


def _font(size: int = 11):
    """DejaVu Sans, which matplotlib ships (the same on every machine), else Pillow's bitmap font."""
    from matplotlib import font_manager

    try:
        return ImageFont.truetype(font_manager.findfont("DejaVu Sans", fallback_to_default=True), size)
    except (ImportError, OSError):  # Pillow without FreeType
        return ImageFont.load_default()


def object_label(obj) -> str:
    """'small red circle' from a key.json object's attributes (or its --boxes word)."""
    keys = ("size", "color", "shape", "label")
    return " ".join(obj.attrs[k] for k in keys if obj.attrs.get(k)) or "object"


def overlay(pic: Image.Image, map_hw: np.ndarray, lut: np.ndarray) -> Image.Image:
    """The map, nearest-upsampled to the picture, coloured by `lut`, over it with value-scaled opacity."""
    top = float(map_hw.max())
    norm_hw = map_hw / top if top > 0 else np.zeros_like(map_hw)
    heat = Image.fromarray(lut[np.clip((norm_hw * 255).astype(int), 0, 255)]).resize(pic.size, Image.NEAREST)
    alpha_hw = (255 * (ALPHA[0] + (ALPHA[1] - ALPHA[0]) * np.clip(norm_hw, 0, 1))).astype(np.uint8)
    return Image.composite(heat, pic, Image.fromarray(alpha_hw).resize(pic.size, Image.NEAREST))


def draw_box(d: ImageDraw.ImageDraw, rect: list[float], label: str, width: int, color=BOX) -> None:
    """An outlined box with its label in a filled tag above it (below it at the top edge), kept inside
    a picture `width` px wide."""
    x0, y0, x1, y1 = rect
    d.rectangle(rect, outline=color, width=2)
    if not label:
        return
    font = _font(10)
    _, _, tw, th = d.textbbox((0, 0), label, font=font)
    ty = y0 - th - 3 if y0 >= th + 3 else y1 + 2
    x0 = max(0, min(x0, width - tw - 4))
    d.rectangle([x0, ty, x0 + tw + 3, ty + th + 2], fill=color)
    d.text((x0 + 2, ty), label, fill="black", font=font)


def display_size(medium: MediumInfo) -> tuple[int, int]:
    """(width, height) of a panel's picture."""
    oh, ow = medium.orig_hw
    s = PANEL / max(oh, ow)
    return max(1, round(ow * s)), max(1, round(oh * s))


def heat_panel(frame_HW3: np.ndarray, map_hw: np.ndarray | None, medium: MediumInfo, title: str,
               boxes: list | None = None, argmax: tuple[int, int] | None = None,
               lut: np.ndarray | None = None) -> Image.Image:
    """One frame with a map over it (None: the bare frame), boxes ([x0, y0, x1, y1] original px) and
    the argmax token."""
    w, h = display_size(medium)
    pic = Image.fromarray(frame_HW3).convert("RGB").resize((w, h), Image.NEAREST)
    if map_hw is not None:
        pic = overlay(pic, map_hw, _lut() if lut is None else lut)
    d = ImageDraw.Draw(pic)
    sx, sy = w / medium.orig_hw[1], h / medium.orig_hw[0]
    scaled = lambda r: [r[0] * sx, r[1] * sy, r[2] * sx - 1, r[3] * sy - 1]  # noqa: E731
    if argmax is not None:
        d.rectangle(scaled(cell_rects(medium)[argmax]), outline=ARGMAX, width=2)
    for item in boxes or []:
        rect, label = item if len(item) == 2 else (item, "")
        draw_box(d, scaled(rect), label, w)
    out = Image.new("RGB", (w, h + TITLE), "white")
    out.paste(pic, (0, TITLE))
    ImageDraw.Draw(out).text((2, 2), title, fill="black", font=_font())
    return out


def compose(panels: list[list[Image.Image]], row_labels: list[str], title: str, pad: int = 4) -> Image.Image:
    """A grid of equally sized panels with row labels on the left and a title on top."""
    pw, ph = panels[0][0].size
    label_w = max(8 + 7 * max((len(s) for s in row_labels), default=0), 8)
    cols = max(len(r) for r in panels)
    W = label_w + cols * (pw + pad) + pad
    H = 22 + len(panels) * (ph + pad) + pad
    out = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(out)
    d.text((pad, 4), title, fill="black", font=_font())
    for r, row in enumerate(panels):
        y = 22 + r * (ph + pad)
        d.text((pad, y + ph // 2), row_labels[r], fill="black", font=_font())
        for c, p in enumerate(row):
            out.paste(p, (label_w + pad + c * (pw + pad), y))
    return out


def head_views(map_Hthw: np.ndarray, heads: str | list[int]) -> list[tuple[str, np.ndarray]]:
    """--heads mean|all|3,5 -> [(label, (t, h, w) map)]."""
    mean = ("heads mean", map_Hthw.mean(0))
    if heads == "mean":
        return [mean]
    picked = range(map_Hthw.shape[0]) if heads == "all" else heads
    views = [(f"head {h}", map_Hthw[h]) for h in picked]
    return [mean, *views] if heads == "all" else views


def image_token_picture(maps: dict[int, np.ndarray], medium: MediumInfo, heads: str | list[int], title: str,
                        layer_kinds: dict[int, str], boxes: list | None = None) -> Image.Image:
    """Columns = layers, rows = head views. maps: layer -> (H, 1, h, w) probabilities; a panel's
    m= is the view's probability mass on the medium."""
    lut = _lut()
    frame = medium.frames_THW3[0]
    rows, labels = [], []
    for r, (label, _) in enumerate(head_views(next(iter(maps.values())), heads)):
        row = []
        for layer, m in maps.items():
            view = head_views(m, heads)[r][1][0]
            am = np.unravel_index(int(np.argmax(view)), view.shape)
            row.append(heat_panel(frame, view, medium, f"L{layer}{layer_kinds[layer]} m={view.sum():.2f}",
                                  boxes, am, lut))
        rows.append(row)
        labels.append(label)
    return compose(rows, labels, title)


def video_token_pictures(maps: dict[int, np.ndarray], medium: MediumInfo, heads: str | list[int], title: str,
                         layer_kinds: dict[int, str], boxes_per_slice: list[list] | None = None
                         ) -> tuple[Image.Image, list[Image.Image]]:
    """(strip, GIF frames). Strip: rows = layers x head views, columns = temporal slices (each shown
    by its first frame; m= is the mass on that slice). GIF: one frame per slice, layers side by side
    (first head view)."""
    lut = _lut()
    t = medium.grid_thw[0]
    rows, labels = [], []
    gif_rows: list[list[Image.Image]] = [[] for _ in range(t)]
    for layer, m in maps.items():
        for r, (label, view_thw) in enumerate(head_views(m, heads)):
            row = []
            for s in range(t):
                frame = medium.frames_THW3[medium.slice_frames[s][0]]
                am = np.unravel_index(int(np.argmax(view_thw[s])), view_thw[s].shape)
                boxes = boxes_per_slice[s] if boxes_per_slice else None
                label = f"t{s} L{layer}{layer_kinds[layer]} m={view_thw[s].sum():.2f}"
                p = heat_panel(frame, view_thw[s], medium, label, boxes, am, lut)
                row.append(p)
                if r == 0:
                    gif_rows[s].append(p)
            rows.append(row)
            labels.append(f"L{layer} {label}")
    strip = compose(rows, labels, title)
    gif = [compose([row], [f"slice {s}"], title) for s, row in enumerate(gif_rows)]
    return strip, gif


def save_gif(frames: list[Image.Image], path: Path, ms: int = 600) -> None:
    pal = [f.convert("P", palette=Image.ADAPTIVE, colors=255) for f in frames]
    pal[0].save(path, save_all=True, append_images=pal[1:], duration=ms, loop=0, optimize=False)


def medium_strip(medium: MediumInfo, title: str) -> Image.Image:
    """The frames the model saw (one per temporal slice), with every object's box."""
    panels = []
    for s in range(medium.grid_thw[0]):
        f = medium.slice_frames[s][0]
        boxes = [(o.boxes[medium.box_frame(f, len(o.boxes))], object_label(o)) for o in medium.objects]
        panels.append(heat_panel(medium.frames_THW3[f], None, medium, f"slice {s}" if medium.grid_thw[0] > 1
                                 else f"{medium.grid_thw[1]}x{medium.grid_thw[2]} tokens", boxes))
    return compose([panels], [""], title)


# ----- matplotlib figures ------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def mass_grid(mass_LH: np.ndarray, layers: list[int], layer_kinds: dict[int, str], path: Path,
              title: str = "text-to-visual attention mass") -> None:
    """Layers x heads grid of mean text-to-visual mass, with a head-mean column."""
    plt = _pyplot()
    grid = np.concatenate([mass_LH, mass_LH.mean(1, keepdims=True)], axis=1)
    fig, ax = plt.subplots(figsize=(1.1 + 0.75 * grid.shape[1], 0.9 + 0.5 * grid.shape[0]), dpi=110)
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(float(grid.max()), 1e-6), aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                color="white" if v < 0.6 * grid.max() else "black")
    ax.set_xticks(range(grid.shape[1]), [f"h{h}" for h in range(mass_LH.shape[1])] + ["mean"])
    ax.set_yticks(range(len(layers)), [f"L{l} {layer_kinds[l]}" for l in layers])
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def block_pattern(kept_GQN, reach_QN, visual_N: np.ndarray, layer: int, path: Path) -> None:
    """A sparse layer's kept key blocks per query block (one panel per selection head): blue with
    the share of the block's tokens that keep it (selection is per token), orange where reachable
    under the token rule but cut by the sparse rule, grey where unreachable; visual blocks marked."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    kept, reach = np.asarray(kept_GQN, np.float32), np.asarray(reach_QN, bool)
    G = kept.shape[0]
    fig, axes = plt.subplots(1, G, figsize=(1.0 + 2.6 * G, 3.2), dpi=110, squeeze=False)
    blue, orange, grey = (np.array(c) for c in ((0.13, 0.40, 0.67), (0.96, 0.65, 0.51), (0.95, 0.95, 0.95)))
    for g, ax in enumerate(axes[0]):
        share = kept[g][..., None]
        rgb = np.where(reach[..., None], np.where(share > 0, 1 - share * (1 - blue), orange), grey)
        ax.imshow(rgb, interpolation="nearest")
        for n in np.nonzero(visual_N)[0]:
            ax.plot([n - 0.5, n + 0.5], [-0.9, -0.9], color="#1b9e77", lw=4, clip_on=False)
        ax.set_title(f"layer {layer}, selection head {g}", fontsize=8)
        ax.set_xlabel("key block (green: holds visual tokens)", fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("query block", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.text(0.01, 0.01, "blue: kept (darker: by more of the block's tokens)   orange: cut by the sparse rule"
             "   grey: not reachable", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def pointing_chart(summary: dict, layers: list[int], path: Path,
                   categories: tuple[str, ...] = ("colour", "shape", "size")) -> None:
    """Pointing-game accuracy per layer for each word category, with both chance levels."""
    plt = _pyplot()
    cats = [c for c in categories if c in summary] or [c for c in summary if "/" not in c]
    keys = [str(l) for l in layers]
    fig, ax = plt.subplots(figsize=(max(3.8, 1.5 + 1.3 * len(cats)), 3.2), dpi=110)
    width = 0.8 / (len(keys) + 1)
    for i, k in enumerate([*keys, "mean"]):
        vals = [summary[c]["accuracy"][k] if k != "mean" else summary[c]["accuracy_mean_layers"]
                for c in cats]
        ax.bar(np.arange(len(cats)) + i * width, vals, width, label=f"L{k}" if k != "mean" else "mean map")
    for j, c in enumerate(cats):
        x0, x1 = j - width / 2, j + width * (len(keys) + 0.5)
        ax.plot([x0, x1], [summary[c]["chance_cell"]] * 2, "k--", lw=1)
        ax.plot([x0, x1], [summary[c]["chance"]] * 2, "k:", lw=1)
    ax.set_xticks(np.arange(len(cats)) + width * len(keys) / 2, [f"{c}\n(n={summary[c]['n']})" for c in cats])
    ax.set_ylim(0, 1)
    ax.set_ylabel("pointing accuracy")
    ax.set_title("pointing game\n(dashed: random-token chance, dotted: box share)", fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
