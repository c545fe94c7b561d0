"""The shapes world: scene sampling and the words that describe scenes.

Every attribute of an object (colour, shape, size, position, motion) is drawn uniformly and
independently, so a caption's content words cannot be predicted from the text before them:
only the pixels tell. Text-only documents, by contrast, state facts and then derive
consequences from them, so a text-only model can learn the later part from the earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Bright, pairwise distinct colours (min RGB distance ~100) on a dark background.
COLORS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (230, 40, 40)),
    ("green", (40, 190, 60)),
    ("blue", (60, 100, 250)),
    ("yellow", (240, 220, 50)),
    ("purple", (170, 70, 230)),
    ("orange", (250, 140, 30)),
    ("cyan", (50, 220, 230)),
    ("white", (240, 240, 240)),
)
COLOR_NAMES = tuple(name for name, _ in COLORS)
SHAPES = ("circle", "square", "triangle", "star", "cross")
SIZES = ("small", "large")
# 3x3 grid, index = row * 3 + col.
POSITIONS = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
MOTIONS = ("moves left", "moves right", "moves up", "moves down", "grows", "shrinks")
# Counted in captions up to 2 objects x 9 images (SynthConfig.max_images <= 9) of one colour.
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen")


def color_rgb(name: str) -> tuple[int, int, int]:
    return dict(COLORS)[name]


@dataclass(frozen=True)
class Obj:
    shape: str
    color: str
    size: str
    position: str  # for a moving object: where it starts
    motion: str | None = None  # video only

    @property
    def cell(self) -> tuple[int, int]:
        """(row, col) in the 3x3 grid."""
        return divmod(POSITIONS.index(self.position), 3)

    def noun(self) -> str:
        return f"a {self.size} {self.color} {self.shape}"


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def sample_objects(rng: np.random.Generator, max_objects: int = 2) -> list[Obj]:
    """1..max_objects objects in distinct grid cells (so they never overlap), in reading order.

    Captions name objects in that order (top to bottom, left to right), so which object a word
    describes is decided by the pixels, not by a coin flip the model cannot see.
    """
    n = int(rng.integers(1, max_objects + 1))
    cells = np.sort(rng.choice(len(POSITIONS), size=n, replace=False))
    return [
        Obj(_pick(rng, SHAPES), _pick(rng, COLOR_NAMES), _pick(rng, SIZES), POSITIONS[int(c)]) for c in cells
    ]


def _start_cell(rng: np.random.Generator, motion: str) -> int:
    """A start cell from which the motion crosses the image (e.g. 'moves right' starts at col 0)."""
    lane = int(rng.integers(3))
    if motion == "moves right":
        return lane * 3
    if motion == "moves left":
        return lane * 3 + 2
    if motion == "moves down":
        return lane
    if motion == "moves up":
        return 6 + lane
    return int(rng.integers(len(POSITIONS)))


def _lane(obj: Obj) -> tuple[str, int]:
    row, col = obj.cell
    if obj.motion in ("moves left", "moves right"):
        return "row", row
    if obj.motion in ("moves up", "moves down"):
        return "col", col
    return "cell", row * 3 + col


def sample_video_objects(rng: np.random.Generator, max_objects: int = 2) -> list[Obj]:
    """1..max_objects moving objects; two objects never share a lane (a row, a column or a cell)."""
    n = 1 if max_objects < 2 or rng.random() < 0.6 else 2
    out: list[Obj] = []
    while len(out) < n:
        motion = _pick(rng, MOTIONS)
        obj = Obj(
            _pick(rng, SHAPES), _pick(rng, COLOR_NAMES), _pick(rng, SIZES),
            POSITIONS[_start_cell(rng, motion)], motion,
        )  # fmt: skip
        if all(_lane(o) != _lane(obj) for o in out):
            out.append(obj)
    return sorted(out, key=lambda o: POSITIONS.index(o.position))  # reading order of start cells


# ---- captions -------------------------------------------------------------------------------

_IMAGE_TEMPLATES = ("{objs}.", "there is {objs}.", "a picture of {objs}.", "this image shows {objs}.")
_VIDEO_TEMPLATES = ("{objs}.", "in this video {objs}.", "a clip where {objs}.")


def _and(parts: list[str]) -> str:
    return " and ".join(parts)


def describe(objs: list[Obj]) -> str:
    """'a large red circle at the top left and a small blue star at the right'."""
    return _and([f"{o.noun()} at the {o.position}" for o in objs])


def image_caption(rng: np.random.Generator, objs: list[Obj]) -> str:
    if rng.random() < 0.2:  # place first: "at the top there is a small red star."
        return _and([f"at the {o.position} there is {o.noun()}" for o in objs]) + "."
    return _pick(rng, _IMAGE_TEMPLATES).format(objs=describe(objs))


def video_caption(rng: np.random.Generator, objs: list[Obj]) -> str:
    return _pick(rng, _VIDEO_TEMPLATES).format(objs=_and([f"{o.noun()} {o.motion}" for o in objs]))


# ---- interleaved documents ------------------------------------------------------------------

_INTROS = ("Here are some pictures.", "Look at these {n} pictures.", "A short album of shapes.", "")
_SHOWS = ("Picture {i} shows {objs}.", "In picture {i} there is {objs}.", "Picture {i}: {objs}.")
_CONNECTIVES = ("Here is another one.", "Next,", "And one more.", "", "")


def interleaved_texts(rng: np.random.Generator, scenes: list[list[Obj]]) -> list[str | None]:
    """Segments in order; None marks where picture i goes. Each caption follows its picture."""
    segs: list[str | None] = []
    intro = _pick(rng, _INTROS).format(n=NUMBER_WORDS[len(scenes)])
    if intro:
        segs.append(intro)
    for i, objs in enumerate(scenes):
        if i > 0 and (conn := _pick(rng, _CONNECTIVES)):
            segs.append(conn)
        segs.append(None)
        segs.append(_pick(rng, _SHOWS).format(i=i + 1, objs=describe(objs)))
    # A closing count is deducible from the captions above: text can learn it, not the pixels.
    color = _pick(rng, [o.color for objs in scenes for o in objs])
    k = sum(o.color == color for objs in scenes for o in objs)
    segs.append(f"In total {NUMBER_WORDS[k]} {'shape was' if k == 1 else 'shapes were'} {color}.")
    return segs


# ---- text-only documents --------------------------------------------------------------------


def _distinct_shapes(rng: np.random.Generator, n: int) -> list[Obj]:
    shapes = rng.choice(len(SHAPES), size=n, replace=False)
    cells = rng.choice(len(POSITIONS), size=n, replace=False)
    return [
        Obj(SHAPES[int(s)], _pick(rng, COLOR_NAMES), _pick(rng, SIZES), POSITIONS[int(c)])
        for s, c in zip(shapes, cells)
    ]


def _relation(a: Obj, b: Obj) -> str:
    (ra, ca), (rb, cb) = a.cell, b.cell
    if ca != cb:
        return "left of" if ca < cb else "right of"
    return "above" if ra < rb else "below"


def _para_relation(rng: np.random.Generator) -> str:
    a, b = _distinct_shapes(rng, 2)
    return (
        f"the {a.color} {a.shape} is at the {a.position}. the {b.color} {b.shape} is at the "
        f"{b.position}. so the {a.shape} is {_relation(a, b)} the {b.shape}."
    )


def _para_recall(rng: np.random.Generator) -> str:
    objs = _distinct_shapes(rng, int(rng.integers(2, 4)))
    facts = " ".join(f"the {o.shape} is {o.color}." for o in objs)
    q = _pick(rng, objs)
    return f"{facts} what colour is the {q.shape}? the {q.shape} is {q.color}."


def _para_count(rng: np.random.Generator) -> str:
    objs = sample_objects(rng, 1) + sample_objects(rng, 1) + sample_objects(rng, 2)
    listed = ", ".join(f"a {o.color} {o.shape}" for o in objs[:-1]) + f" and a {objs[-1].color} "
    listed += objs[-1].shape
    color = _pick(rng, [o.color for o in objs])
    k = sum(o.color == color for o in objs)
    noun = "shape" if k == 1 else "shapes"
    return f"there is {listed}. so there {'is' if k == 1 else 'are'} {NUMBER_WORDS[k]} {color} {noun}."


def _para_move(rng: np.random.Generator) -> str:
    (o,) = _distinct_shapes(rng, 1)
    row, col = o.cell
    moves = [(m, dr, dc) for m, dr, dc in (("left", 0, -1), ("right", 0, 1), ("up", -1, 0), ("down", 1, 0))
             if 0 <= row + dr < 3 and 0 <= col + dc < 3]  # fmt: skip
    m, dr, dc = _pick(rng, moves)
    end = POSITIONS[(row + dr) * 3 + col + dc]
    return f"a {o.color} {o.shape} is at the {o.position}. it moves {m}. now it is at the {end}."


def _para_size(rng: np.random.Generator) -> str:
    a, b = _distinct_shapes(rng, 2)
    if a.size == b.size:
        return f"the {a.shape} is {a.size}. the {b.shape} is {b.size}. so they have the same size."
    bigger, smaller = (a, b) if a.size == "large" else (b, a)
    return (
        f"the {a.shape} is {a.size}. the {b.shape} is {b.size}. so the {bigger.shape} is bigger "
        f"than the {smaller.shape}."
    )


_PARAGRAPHS = (_para_relation, _para_recall, _para_count, _para_move, _para_size)


def text_document(rng: np.random.Generator) -> str:
    """2..4 short paragraphs, each of facts followed by what follows from them."""
    n = int(rng.integers(2, 5))
    return "\n".join(_pick(rng, _PARAGRAPHS)(rng) for _ in range(n))
