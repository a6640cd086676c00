"""A video clip -> `num_frames` RGB frames sampled uniformly over it (each is then encoded like an image).

A clip is a list of frames (anything `load_image` takes), a uint8/float array [F, H, W, 3], or the bytes or
data: URI of an animated image (GIF, WebP, APNG: whatever PIL's ImageSequence reads). Only the sampled
frames are converted.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from tokenmill.multimodal.fetch import decode_data_uri
from tokenmill.multimodal.image import check_pixels, decoded, load_image, open_encoded, to_rgb


def load_video(source, num_frames: int, max_pixels: int) -> list[Image.Image]:
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
    if isinstance(source, str):
        source = decode_data_uri(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _animated_frames(bytes(source), num_frames, max_pixels)
    if isinstance(source, np.ndarray):
        if source.ndim != 4:
            raise ValueError(f"video array must be [frames, H, W, channels], got shape {source.shape}")
    elif not isinstance(source, (list, tuple)):
        raise ValueError(f"unsupported video type {type(source).__name__}: expected a list of frames, an array "
                         "[F, H, W, 3], encoded bytes of an animated image or a data: URI")
    if len(source) == 0:
        raise ValueError("video has no frames")
    return [load_image(source[i], max_pixels) for i in sample_indices(len(source), num_frames)]


def sample_indices(total: int, num_frames: int) -> list[int]:
    """`num_frames` indices spread evenly from the first frame to the last; all of them for a shorter clip."""
    if total <= num_frames:
        return list(range(total))
    return [int(i) for i in np.round(np.linspace(0, total - 1, num_frames))]


# an animated image's frames are decoded one after another onto its canvas (frame i needs 0 .. i-1): a clip of
# more frames times canvas pixels than this many times the per-image limit is refused before any is decoded (a
# 37 KB GIF of a 4000 x 4000 canvas and 1,000 one-pixel frames took 40 s)
MAX_CLIP_DECODE_IMAGES = 32
# and a clip of more frames than this is refused whatever its canvas: reaching a sampled frame steps through every
# frame before it (~20 us each), so a 1x1 GIF of 250,000 frames (7.7 MB) took 7 s
MAX_CLIP_FRAMES = 4096


def _animated_frames(data: bytes, num_frames: int, max_pixels: int) -> list[Image.Image]:
    img = open_encoded(data, max_pixels)

    def frames():
        total = getattr(img, "n_frames", 1)  # (counted from the frames' headers: no pixels decoded)
        w, h = img.size
        if total > MAX_CLIP_FRAMES:
            raise ValueError(f"video of {total} frames: at most {MAX_CLIP_FRAMES} are taken")
        if total > 1 and total * w * h > MAX_CLIP_DECODE_IMAGES * max_pixels:
            raise ValueError(f"video of {total} frames of {w}x{h} would decode {total * w * h} pixels, past the limit "
                             f"of {MAX_CLIP_DECODE_IMAGES} x {max_pixels} (--mm-max-image-pixels)")
        out = []
        for i in sample_indices(total, num_frames):
            img.seek(i)
            check_pixels(img.size, max_pixels)  # a TIFF's pages each have their own size
            # copy: the next seek reuses the same image object's buffer
            out.append(to_rgb(img.copy()))
        return out

    return decoded(frames)
