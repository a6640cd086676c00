"""One image from what a caller hands us (PIL image, numpy array, encoded bytes, data: URI) -> RGB PIL image.

Encoded images are refused by their header size before any pixel is decoded: a 40 KB PNG can claim
100k x 100k pixels (a decompression bomb), and `Image.open` reads only the header.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from tokenmill.multimodal.fetch import decode_data_uri

# what untrusted bytes may be parsed as: not every format PIL knows (EPS would run Ghostscript); JPEG includes MPO
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


def load_image(source, max_pixels: int) -> Image.Image:
    if isinstance(source, Image.Image):
        check_pixels(source.size, max_pixels)
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        return to_rgb(array_to_image(source, max_pixels))
    if isinstance(source, str):
        source = decode_data_uri(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        img = open_encoded(bytes(source), max_pixels)
        return decoded(lambda: to_rgb(img))
    raise ValueError(f"unsupported image type {type(source).__name__}: expected a PIL image, a numpy array, "
                     "encoded bytes or a data: URI")


def check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ValueError(f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ValueError(f"image of {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels "
                         "(--mm-max-image-pixels)")


def open_encoded(data: bytes, max_pixels: int) -> Image.Image:
    """Parse the header only (PIL decodes lazily) and check the size before any decoding."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ValueError(f"image exceeds the limit of {max_pixels} pixels ({e})") from None
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, struct.error...
        raise ValueError(f"could not decode image: {e} (accepted formats: {', '.join(FORMATS)})") from None
    check_pixels(img.size, max_pixels)
    return img


def decoded(fn):
    """Run `fn`, which decodes pixels, turning PIL's many failure types into one ValueError."""
    try:
        return fn()
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"could not decode image: {e}") from None


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with transparency composited onto white (what transformers' convert_to_rgb does). 16-bit grey
    (a 16-bit PNG opens as I;16 or I) is scaled to 8 bits first: PIL's conversion clips it, white above 255."""
    if img.mode.startswith("I;16") or (img.mode in ("I", "F") and img.getextrema()[1] > 255):
        grey = np.asarray(img, dtype=np.float64) / 257.0  # (65535 -> 255)
        img = Image.fromarray(np.clip(np.round(grey), 0, 255).astype(np.uint8), "L")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode == "RGB":
        img.load()
        return img
    return img.convert("RGB")


def array_to_image(arr: np.ndarray, max_pixels: int) -> Image.Image:
    """HxW, HxWx1, HxWx3 or HxWx4; uint8, or float in [0, 1]."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise ValueError(f"image array must be HxW, HxWx3 or HxWx4, got shape {arr.shape}")
    check_pixels((arr.shape[1], arr.shape[0]), max_pixels)
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all((arr >= 0) & (arr <= 1)):  # also refuses NaN
            raise ValueError("float image array values must lie in [0, 1]")
        arr = np.round(arr * 255)
    elif arr.dtype != np.uint8:
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > 255:
            raise ValueError(f"image array must be uint8 or float in [0, 1], got {arr.dtype}")
    return Image.fromarray(np.ascontiguousarray(arr, dtype=np.uint8))
