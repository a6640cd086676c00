"""Image preprocessing: tokenmill's ImageProcessor against transformers' CLIP processor (PIL backend), in the
same run, on the same images, checking that the pixels agree.

    python benchmarks/bench_mm_preprocess.py --result-file benchmarks/results/mm_preprocess.json

Shapes: a 64x64 image to a 32x32 crop, and a 640x480 photo-like image to CLIP ViT-L/14-336's 336x336 crop.
Reports CPU ms (time.process_time) and wall ms per image, and HF / ours ratios (above 1: ours is faster).
"""
from __future__ import annotations

import argparse
import io
import json
import time
import warnings

import numpy as np
from PIL import Image

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
SHAPES = {"64x64_to_32": ((64, 64), 32), "640x480_to_336": ((640, 480), 336)}


def photo_like(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """Smooth colour gradients plus sensor-like noise, round-tripped through JPEG like an uploaded photo."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([np.sin(6 * x + 1), np.cos(5 * y), np.sin(4 * (x + y))], axis=-1) * 0.4 + 0.5
    noisy = np.clip(base + rng.normal(0, 0.03, base.shape), 0, 1)
    buf = io.BytesIO()
    Image.fromarray((noisy * 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    img = Image.open(io.BytesIO(buf.getvalue()))
    img.load()
    return img


def per_image_ms(fn, images: list, repeats: int) -> dict:
    for img in images[:3]:  # warm-up
        fn(img)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        for img in images:
            fn(img)
    n = repeats * len(images)
    return {"cpu_ms": (time.process_time() - cpu0) * 1e3 / n, "wall_ms": (time.perf_counter() - wall0) * 1e3 / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--result-file", required=True)
    ap.add_argument("--images", type=int, default=8, help="distinct images per shape")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from tokenmill.multimodal.preprocess import ImageProcessor

    rng = np.random.default_rng(args.seed)
    results = {}
    for name, ((w, h), crop) in SHAPES.items():
        cfg = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": crop},
               "crop_size": {"height": crop, "width": crop}, "resample": 3, "image_mean": CLIP_MEAN,
               "image_std": CLIP_STD}
        hf = CLIPImageProcessorPil(**{k: v for k, v in cfg.items() if k != "image_processor_type"})
        ours = ImageProcessor.from_config(cfg)
        images = [photo_like(w, h, rng) for _ in range(args.images)]
        max_diff = max(float(np.abs(hf([i], return_tensors="np")["pixel_values"] - ours([i])).max()) for i in images)
        t_hf = per_image_ms(lambda i: hf([i], return_tensors="np"), images, args.repeats)
        t_ours = per_image_ms(lambda i: ours([i]), images, args.repeats)
        results[name] = {"hf": t_hf, "ours": t_ours, "max_abs_diff": max_diff,
                         "cpu_ratio_hf_over_ours": t_hf["cpu_ms"] / t_ours["cpu_ms"],
                         "wall_ratio_hf_over_ours": t_hf["wall_ms"] / t_ours["wall_ms"]}
    doc = {"bench": "mm_preprocess", "reference": "transformers CLIPImageProcessorPil", "seed": args.seed,
           "images": args.images, "repeats": args.repeats, "results": results}
    with open(args.result_file, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
