"""CLIP-style image preprocessing from a model's preprocessor_config.json, matching transformers'
CLIPImageProcessor (its PIL/numpy backend) to float rounding.

    RGB -> resize (shortest edge, or height x width; PIL, the configured filter) -> center crop
        -> rescale -> normalize -> float32 [3, H, W]

The same PIL resize makes the same uint8 pixels; rescale and normalize are then one fused float32
multiply-add per value with a per-channel scale and offset (rescale / std, -mean / std), which differs
from transformers' three passes (float64 rescale, float32 (x - mean) / std) by float rounding only
(< 1e-6 for CLIP's constants).

Not done, because they change pixels beyond that tolerance: resizing only the crop's box (PIL's `box`,
~30% less resize work, but its coefficients round differently: off by one level in over half of sizes),
`reducing_gap` and JPEG `draft` (a cheaper, different filter).
"""
from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image

from tokenmill.multimodal.image import to_rgb

SUPPORTED_TYPES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil", "CLIPFeatureExtractor")


class ImageProcessor:
    def __init__(self, *, size: dict, crop_size: dict | None, resample: int = 3, do_resize: bool = True,
                 do_center_crop: bool = True, do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True, image_mean=None, image_std=None):
        self.size = size
        self.crop_size = crop_size
        self.resample = Image.Resampling(resample)
        self.do_resize = do_resize
        self.do_center_crop = do_center_crop
        # an image whose resized size (before the crop) passes this is refused (the processor sets the engine's)
        self.max_resized_pixels = 1 << 26
        self.scale, self.offset = _scale_offset(do_rescale, rescale_factor, do_normalize, image_mean, image_std)

    @classmethod
    def from_model_dir(cls, path: str) -> "ImageProcessor":
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            raise ValueError(f"no preprocessor_config.json in {path}: a multimodal model needs one")
        with open(file) as f:
            return cls.from_config(json.load(f))

    @classmethod
    def from_config(cls, cfg: dict) -> "ImageProcessor":
        kind = cfg.get("image_processor_type") or cfg.get("feature_extractor_type")
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"preprocessor_config.json: image_processor_type {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        flags = {k: bool(cfg.get(k, True)) for k in ("do_resize", "do_center_crop", "do_rescale", "do_normalize")}
        needed = ["size"] * flags["do_resize"] + ["crop_size"] * flags["do_center_crop"]
        needed += ["image_mean", "image_std"] * flags["do_normalize"]
        for field in needed:
            if cfg.get(field) is None:
                raise ValueError(f"preprocessor_config.json: missing field {field!r}")
        resample = cfg.get("resample", 3)
        if resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"preprocessor_config.json: resample {resample!r} is not a PIL resampling filter")
        return cls(size=_size_dict(cfg.get("size"), "size", square=False),
                   crop_size=_size_dict(cfg.get("crop_size"), "crop_size", square=True), resample=resample,
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)), image_mean=cfg.get("image_mean"),
                   image_std=cfg.get("image_std"), **flags)

    def __call__(self, images: list[Image.Image]) -> np.ndarray:
        if not images:
            raise ValueError("no images to preprocess")
        arrays = [self.one(img) for img in images]
        if len({a.shape for a in arrays}) > 1:
            raise ValueError(f"images preprocess to different shapes {sorted({a.shape for a in arrays})}; "
                             "batch them separately")
        return np.stack(arrays)

    def one(self, img: Image.Image) -> np.ndarray:
        img = to_rgb(img)
        if self.do_resize:
            w, h = img.size
            oh, ow = resize_output_size(h, w, self.size)
            if oh * ow > self.max_resized_pixels:  # (a thin image's long edge grows by the short edge's factor)
                raise ValueError(f"image of {w}x{h} would resize to {ow}x{oh} = {ow * oh} pixels, past the limit of "
                                 f"{self.max_resized_pixels} (--mm-max-image-pixels): its aspect ratio is too extreme")
            img = img.resize((ow, oh), resample=self.resample)
        if self.do_center_crop:
            w, h = img.size
            ch, cw = self.crop_size["height"], self.crop_size["width"]
            top, left = (h - ch) // 2, (w - cw) // 2
            # PIL fills outside the image with 0, the same zero padding transformers applies to small images
            img = img.crop((left, top, left + cw, top + ch))
        out = np.asarray(img).transpose(2, 0, 1).astype(np.float32)  # [3, H, W]
        out *= self.scale
        out += self.offset
        return out


def resize_output_size(height: int, width: int, size: dict) -> tuple[int, int]:
    """(height, width) after resizing, as transformers' get_resize_output_image_size (default_to_square=False)."""
    if "shortest_edge" in size:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    return size["height"], size["width"]


def _size_dict(value, field: str, *, square: bool) -> dict | None:
    """An int (old configs) or a dict -> {"shortest_edge": n} or {"height": h, "width": w}."""
    if value is None:
        return None
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, dict):
        if set(value) == {"shortest_edge"} and not square:
            return {"shortest_edge": int(value["shortest_edge"])}
        if set(value) == {"height", "width"}:
            return {"height": int(value["height"]), "width": int(value["width"])}
    raise ValueError(f"preprocessor_config.json: {field} must be an int, {{'height', 'width'}}"
                     f"{'' if square else ' or {shortest_edge}'}, got {value!r}")


def _scale_offset(do_rescale: bool, rescale_factor: float, do_normalize: bool, mean, std):
    """Per-channel float32 [3, 1, 1] scale and offset with pixel * scale + offset = normalize(rescale(pixel))."""
    scale, offset = np.full(3, rescale_factor if do_rescale else 1.0), np.zeros(3)
    if do_normalize:
        # a single number applies to every channel, as in transformers
        mean, std = (np.broadcast_to(np.asarray(a, dtype=np.float64), (3,)) if np.ndim(a) == 0 else
                     np.asarray(a, dtype=np.float64) for a in (mean, std))
        if mean.shape != (3,) or std.shape != (3,):
            raise ValueError(f"preprocessor_config.json: image_mean and image_std need 3 values, got {mean.tolist()} "
                             f"and {std.tolist()}")
        if np.any(std == 0):
            raise ValueError("preprocessor_config.json: image_std has a zero")
        scale, offset = scale / std, -mean / std
    return scale.astype(np.float32)[:, None, None], offset.astype(np.float32)[:, None, None]
