"""Synthetic shapes world for tokenmill's tiny vision-language model (tiny-llava): seeded image/video
question-answer samples, the prompt format, and the scoring rule.

Pure numpy + PIL (no torch), so the engine's tests and benchmarks can import it.

Images are 64x64 RGB, one to four flat shapes (circle / square / triangle in red / green / blue /
yellow) on a plain white-to-light-grey background. Video clips are 4 frames of one shape moving
left / right / up / down. Every task has a one-word answer except "caption":

    task      question                          answers
    colour    what colour is the shape?         red green blue yellow
    shape     what shape is it?                 circle square triangle
    count     how many shapes are there?        one two three four        (shapes in distinct 2x2 cells)
    position  where is the shape?               left right top bottom
    motion    which way does the shape move?    left right up down        (video: 4 frames)
    caption   describe the image.               "a red circle on the left", "... at the top"

Sample i of `make_samples(n, seed)` depends only on (seed, i, its task), so any prefix of a set is
reproducible on its own. `eval_samples()` uses EVAL_SEED, which training never uses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64  # drawn size; the model's image processor resizes down
NUM_FRAMES = 4
IMAGE_TOKEN = "<image>"
EVAL_SEED = 999_983  # held-out set; training seeds must differ

COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("one", "two", "three", "four")
POSITIONS = ("left", "right", "top", "bottom")
DIRECTIONS = ("left", "right", "up", "down")

QUESTIONS = {
    "colour": "what colour is the shape?",
    "shape": "what shape is it?",
    "count": "how many shapes are there?",
    "position": "where is the shape?",
    "motion": "which way does the shape move?",
    "caption": "describe the image.",
}
# Possible answers of each one-word task (chance accuracy = 1 / len).
ANSWERS = {
    "colour": tuple(COLOURS),
    "shape": SHAPES,
    "count": NUMBERS,
    "position": POSITIONS,
    "motion": DIRECTIONS,
}
IMAGE_TASKS = ("colour", "shape", "count", "position", "caption")
VIDEO_TASKS = ("motion",)
TASKS = IMAGE_TASKS + VIDEO_TASKS
ONE_WORD_TASKS = ("colour", "shape", "count", "position", "motion")  # the default mix and the eval set

# Every word the samples and the chat template use (the tiny-llava tokenizer's vocabulary is built from
# this plus digits, punctuation and a few spares).
VOCAB_WORDS = sorted(
    {w for q in QUESTIONS.values() for w in re.findall(r"\w+", q)}
    | {w for a in ANSWERS.values() for w in a}
    | {"a", "on", "at", "the", "user", "assistant", "system"}
)


@dataclass
class Sample:
    images: list[Image.Image]  # one image for image tasks, [] for video
    video: list[Image.Image] | None  # NUM_FRAMES frames for video tasks, else None
    question: str
    answer: str
    task: str


# ----------------------------------------------------------------------------- drawing


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    g = int(rng.integers(222, 256))  # white to light grey
    return (g, g, g)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        h = r * 0.88  # about the circle's area
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    else:
        raise ValueError(shape)


def _canvas(bg) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), bg)
    return img, ImageDraw.Draw(img)


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _position_centre(rng: np.random.Generator, where: str, r: int) -> tuple[int, int]:
    """A centre clearly in one half-band: left/right = middle row, top/bottom = middle column."""
    near = int(rng.integers(r + 3, 24 - r // 2 + 1))  # distance of the centre from the edge: 11..21
    mid = int(rng.integers(26, 39))
    return {"left": (near, mid), "right": (IMAGE_SIZE - near, mid),
            "top": (mid, near), "bottom": (mid, IMAGE_SIZE - near)}[where]


def _single(rng, task: str) -> Sample:
    bg = _background(rng)
    colour, shape = _pick(rng, tuple(COLOURS)), _pick(rng, SHAPES)
    img, draw = _canvas(bg)
    if task in ("position", "caption"):
        where = _pick(rng, POSITIONS)
        r = int(rng.integers(7, 11))
        cx, cy = _position_centre(rng, where, r)
    else:
        r = int(rng.integers(8, 15))
        cx, cy = (int(rng.integers(r + 2, IMAGE_SIZE - r - 1)) for _ in range(2))
    _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    if task == "caption":
        answer = f"a {colour} {shape} " + ("on the " if where in ("left", "right") else "at the ") + where
    else:
        answer = {"colour": colour, "shape": shape}.get(task) or where
    return Sample([img], None, QUESTIONS[task], answer, task)


def _count(rng) -> Sample:
    img, draw = _canvas(_background(rng))
    n = int(rng.integers(1, 5))
    cells = rng.permutation(4)[:n]
    half = IMAGE_SIZE // 2
    for cell in cells:
        r = int(rng.integers(6, 11))
        slack = half // 2 - r - 2
        cx = (cell % 2) * half + half // 2 + int(rng.integers(-slack, slack + 1))
        cy = (cell // 2) * half + half // 2 + int(rng.integers(-slack, slack + 1))
        _draw_shape(draw, _pick(rng, SHAPES), cx, cy, r, COLOURS[_pick(rng, tuple(COLOURS))])
    return Sample([img], None, QUESTIONS["count"], NUMBERS[n - 1], "count")


def _motion(rng) -> Sample:
    bg = _background(rng)
    colour, shape, direction = _pick(rng, tuple(COLOURS)), _pick(rng, SHAPES), _pick(rng, DIRECTIONS)
    r = int(rng.integers(7, 11))
    step = int(rng.integers(7, 11))
    travel = step * (NUM_FRAMES - 1)
    lo, hi = r + 2, IMAGE_SIZE - r - 2
    along = int(rng.integers(lo, hi - travel + 1))  # start on the moving axis
    across = int(rng.integers(lo, hi + 1))
    sign = 1 if direction in ("right", "down") else -1
    if sign < 0:
        along = IMAGE_SIZE - along
    frames = []
    for f in range(NUM_FRAMES):
        p = along + sign * step * f
        cx, cy = (p, across) if direction in ("left", "right") else (across, p)
        img, draw = _canvas(bg)
        _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
        frames.append(img)
    return Sample([], frames, QUESTIONS["motion"], direction, "motion")


def make_sample(seed: int, index: int, task: str) -> Sample:
    rng = np.random.default_rng([seed, index])
    if task == "count":
        return _count(rng)
    if task == "motion":
        return _motion(rng)
    if task in IMAGE_TASKS:
        return _single(rng, task)
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")


def make_samples(n: int, seed: int, tasks: tuple[str, ...] | None = None) -> list[Sample]:
    """n samples, tasks in turn (sample i has task tasks[i % len(tasks)]); default: the one-word tasks."""
    tasks = tuple(tasks) if tasks else ONE_WORD_TASKS
    return [make_sample(seed, i, tasks[i % len(tasks)]) for i in range(n)]


def eval_samples(n: int = 200) -> list[Sample]:
    """The held-out set: every one-word task equally (4 image tasks + video motion), seed EVAL_SEED."""
    return make_samples(n, EVAL_SEED, ONE_WORD_TASKS)


# ----------------------------------------------------------------------------- prompt format


def chat_messages(sample: Sample) -> list[dict]:
    n = len(sample.video) if sample.video is not None else len(sample.images)
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": sample.question}]}]


def prompt_text(sample: Sample) -> str:
    """tiny-llava's chat template applied to chat_messages(sample) with add_generation_prompt=True: one
    literal <image> per image or frame (before expansion to the model's image_seq_length tokens)."""
    n = len(sample.video) if sample.video is not None else len(sample.images)
    return "<s>user: " + " ".join([IMAGE_TOKEN] * n + [sample.question]) + " assistant:"


def normalize_words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.strip().lower()).split()


def is_correct(sample: Sample, generated_text: str) -> bool:
    """The generated text starts with the answer: its first word (lowercased, punctuation removed) equals a
    one-word answer; for a caption, its first words equal the caption's."""
    want = normalize_words(sample.answer)
    return normalize_words(generated_text)[:len(want)] == want
