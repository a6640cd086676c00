"""Multimodal input side: image/video loading and limits, URL fetching (a real loopback server), CLIP
preprocessing against transformers, and chat content parts -> conversation + media."""
from __future__ import annotations

import base64
import io
import struct
import threading
import time
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from tokenmill.multimodal.chat import make_resolvers, parse_chat_messages
from tokenmill.multimodal.fetch import decode_data_uri, fetch_url
from tokenmill.multimodal.image import load_image
from tokenmill.multimodal.preprocess import ImageProcessor
from tokenmill.multimodal.video import load_video, sample_indices

BIG = 10**8
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, with no pixel data at all."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def animated_gif(colors: list[tuple[int, int, int]], fmt: str = "GIF") -> bytes:
    frames = [Image.new("RGB", (8, 6), c) for c in colors]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=40, loop=0)


# ---------------------------------------------------------------- preprocessing vs transformers

def hf_reference(**cfg):
    """transformers 5 has no slow CLIPImageProcessor class any more: without torchvision the name falls back to
    the PIL/numpy backend, CLIPImageProcessorPil, which is the reference here."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    return CLIPImageProcessorPil(**cfg)


PREPROCESS_CONFIGS = [
    dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_mean=CLIP_MEAN,
         image_std=CLIP_STD),
    dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    dict(size={"shortest_edge": 48}, crop_size={"height": 40, "width": 48}, resample=2),
    dict(size={"height": 30, "width": 50}, crop_size={"height": 40, "width": 44}),  # crop larger than image: pads
    dict(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24}, do_normalize=False),
]


@pytest.mark.parametrize("cfg", PREPROCESS_CONFIGS, ids=lambda c: str(c["size"]))
def test_preprocess_matches_transformers(cfg, tmp_path):
    hf = hf_reference(**cfg)
    hf.save_pretrained(tmp_path)  # the preprocessor_config.json transformers itself writes
    ours = ImageProcessor.from_model_dir(str(tmp_path))
    rgba = noise(50, 70, seed=9).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.random.default_rng(3).integers(0, 256, (70, 50), dtype=np.uint8)))
    images = [noise(w, h, seed=w) for w, h in [(64, 64), (640, 480), (480, 640), (17, 91), (300, 7)]]
    images += [rgba, noise(40, 40).convert("L")]
    for img in images:
        want = hf([img], return_tensors="np")["pixel_values"]
        got = ours([img])
        assert got.dtype == np.float32 and got.shape == want.shape, (img.size, got.shape, want.shape)
        assert np.abs(got - want).max() <= 1e-5, img.size
    batch = ours(images[:3])
    assert batch.shape[0] == 3 and np.array_equal(batch[1], ours([images[1]])[0])


def test_preprocess_old_style_config():
    # LLaVA-1.5's original file: CLIPFeatureExtractor with int sizes
    cfg = {"feature_extractor_type": "CLIPFeatureExtractor", "size": 36, "crop_size": 36, "do_center_crop": True,
           "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3}
    img = noise(80, 50)
    want = hf_reference(size={"shortest_edge": 36}, crop_size={"height": 36, "width": 36})([img],
                                                                                          return_tensors="np")
    assert np.abs(ImageProcessor.from_config(cfg)([img]) - want["pixel_values"]).max() <= 1e-5


@pytest.mark.parametrize("cfg,field", [
    ({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
    ({}, "image_processor_type"),
    ({"image_processor_type": "CLIPImageProcessor", "crop_size": 8, "image_mean": CLIP_MEAN,
      "image_std": CLIP_STD}, "size"),
    ({"image_processor_type": "CLIPImageProcessor", "size": 8, "crop_size": 8, "image_mean": CLIP_MEAN}, "image_std"),
    ({"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 8}, "crop_size": 8,
      "image_mean": CLIP_MEAN, "image_std": CLIP_STD}, "size"),
    ({"image_processor_type": "CLIPImageProcessor", "size": 8, "crop_size": 8, "image_mean": [0.5, 0.5],
      "image_std": CLIP_STD}, "image_mean"),
])
def test_preprocess_config_errors(cfg, field):
    with pytest.raises(ValueError, match=field):
        ImageProcessor.from_config(cfg)


def test_preprocess_missing_file(tmp_path):
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        ImageProcessor.from_model_dir(str(tmp_path))


# ---------------------------------------------------------------- images

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_load_image_formats(fmt):
    img = Image.new("RGB", (20, 10), (200, 30, 60))
    out = load_image(encode(img, fmt), max_pixels=BIG)
    assert out.mode == "RGB" and out.size == (20, 10)
    assert np.abs(np.asarray(out, dtype=int) - [200, 30, 60]).max() <= 12  # lossy formats and palettes


def test_load_image_sources():
    arr = np.random.default_rng(0).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    assert np.array_equal(np.asarray(load_image(arr, BIG)), arr)
    assert np.array_equal(np.asarray(load_image(Image.fromarray(arr), BIG)), arr)
    assert np.array_equal(np.asarray(load_image(data_uri(encode(Image.fromarray(arr))), BIG)), arr)
    floats = load_image(arr / 255.0, BIG)
    assert np.array_equal(np.asarray(floats), arr)
    gray = load_image(arr[:, :, 0], BIG)
    assert gray.mode == "RGB" and np.array_equal(np.asarray(gray)[:, :, 2], arr[:, :, 0])
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent -> white, like transformers
    assert np.asarray(load_image(clear, BIG)).tolist() == np.full((4, 4, 3), 255).tolist()


@pytest.mark.parametrize("source,match", [
    (b"\x89PNG\r\n\x1a\n garbage after a PNG signature", "could not decode image"),
    (b"Just a text file.\nNot an image.\n", "could not decode image"),
    (encode(noise(40, 40), "PNG")[:200], "could not decode image"),  # truncated
    (encode(noise(4, 4), "PPM"), "accepted formats"),  # PIL reads it, but it is not on the list
    ("data:image/png;base64,@@@not-base64@@@", "invalid base64"),
    ("data:image/png;base64", "bad data URI"),
    ("https://example.com/cat.png", "bad data URI"),
    (np.zeros((4, 4, 2), np.uint8), "shape"),
    (np.full((4, 4, 3), 1.5), r"\[0, 1\]"),
    (np.full((4, 4, 3), 300, np.int32), "uint8"),
    (12345, "unsupported image type int"),
])
def test_load_image_errors(source, match):
    with pytest.raises(ValueError, match=match):
        load_image(source, max_pixels=BIG)


def test_pixel_limit_checked_before_decoding():
    header = png_header_only(5000, 4000)  # no pixel data: decoding it would fail differently
    with pytest.raises(ValueError, match=r"5000x4000 = 20000000 pixels exceeds the limit of 1000000"):
        load_image(header, max_pixels=1_000_000)
    with pytest.raises(ValueError, match="could not decode image"):
        load_image(header, max_pixels=BIG)
    # far past PIL's own decompression-bomb guard: still our ValueError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="exceeds the limit"):
            load_image(png_header_only(100_000, 100_000), max_pixels=BIG)


def test_pixel_limit_real_images():
    bomb = encode(Image.new("RGB", (2000, 1000)))  # 2 Mpixel of zeros: a few KB compressed
    assert len(bomb) < 20_000
    with pytest.raises(ValueError, match="exceeds the limit of 1000000 pixels"):
        load_image(bomb, max_pixels=1_000_000)
    assert load_image(bomb, max_pixels=2_000_000).size == (2000, 1000)
    with pytest.raises(ValueError, match="exceeds the limit"):
        load_image(np.zeros((100, 101, 3), np.uint8), max_pixels=10_000)
    with pytest.raises(ValueError, match="exceeds the limit"):
        load_image(Image.new("RGB", (101, 100)), max_pixels=10_000)


# ---------------------------------------------------------------- video

COLORS = [(i * 25, 255 - i * 25, (i * 70) % 256) for i in range(10)]


def frame_color(img: Image.Image) -> tuple:
    return tuple(int(v) for v in np.asarray(img)[0, 0])


def nearest(color) -> int:
    return int(np.argmin([sum(abs(a - b) for a, b in zip(color, c)) for c in COLORS]))


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_video_sampled_uniformly(fmt):
    clip = animated_gif(COLORS, fmt)
    frames = load_video(clip, num_frames=4, max_pixels=BIG)
    assert [f.size for f in frames] == [(8, 6)] * 4 and all(f.mode == "RGB" for f in frames)
    assert [nearest(frame_color(f)) for f in frames] == [0, 3, 6, 9]
    via_uri = load_video(data_uri(clip, "image/gif"), num_frames=4, max_pixels=BIG)
    assert [frame_color(f) for f in via_uri] == [frame_color(f) for f in frames]
    assert len(load_video(clip, num_frames=32, max_pixels=BIG)) == 10  # a short clip keeps every frame


def test_video_arrays_and_lists():
    arr = np.stack([np.full((4, 5, 3), i, np.uint8) for i in range(7)])
    frames = load_video(arr, num_frames=3, max_pixels=BIG)
    assert [frame_color(f)[0] for f in frames] == [0, 3, 6]
    frames = load_video([Image.new("RGB", (3, 3), (i, 0, 0)) for i in range(5)], num_frames=2, max_pixels=BIG)
    assert [frame_color(f)[0] for f in frames] == [0, 4]
    assert sample_indices(100, 5) == [0, 25, 50, 74, 99]
    assert sample_indices(3, 8) == [0, 1, 2]


@pytest.mark.parametrize("source,kw,match", [
    ([], {}, "no frames"),
    (np.zeros((0, 4, 4, 3), np.uint8), {}, "no frames"),
    (np.zeros((4, 4, 3), np.uint8), {}, "shape"),
    (b"GIF89a not really", {}, "could not decode"),
    (animated_gif(COLORS[:2]), {"max_pixels": 10}, "exceeds the limit"),
    ([Image.new("RGB", (10, 10))], {"num_frames": 0}, "num_frames"),
    ({"frames": []}, {}, "unsupported video type dict"),
])
def test_video_errors(source, kw, match):
    with pytest.raises(ValueError, match=match):
        load_video(source, **{"num_frames": 4, "max_pixels": BIG, **kw})


def test_clips_that_would_take_long_to_decode_are_refused_before_decoding():
    """An animated image's frames decode one after another onto its canvas: many frames of a large canvas are
    refused from the headers. A TIFF's pages each have their own size: each is checked before it is decoded."""
    canvas = [Image.new("RGB", (400, 400), (255, 0, 0))] + [Image.new("RGB", (1, 1), (i, 0, 0)) for i in range(60)]
    buf = io.BytesIO()
    canvas[0].save(buf, format="GIF", save_all=True, append_images=canvas[1:], duration=10)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="61 frames of 400x400"):
        load_video(buf.getvalue(), num_frames=4, max_pixels=160_000)
    assert time.perf_counter() - t0 < 1
    assert len(load_video(buf.getvalue(), num_frames=4, max_pixels=1_000_000)) == 4  # within the budget
    pages = [Image.new("1", (1, 1)), Image.new("1", (3000, 3000)), Image.new("1", (3000, 3000))]
    tiff = io.BytesIO()
    pages[0].save(tiff, format="TIFF", save_all=True, append_images=pages[1:], compression="group4")
    with pytest.raises(ValueError, match="3000x3000 = 9000000 pixels exceeds the limit"):
        load_video(tiff.getvalue(), num_frames=4, max_pixels=1_000_000)


def test_a_clip_of_too_many_frames_is_refused_whatever_its_canvas():
    """A 1x1 canvas passed the frames-times-pixels check at any frame count, and reaching the sampled frames steps
    through every frame before them (a 250,000-frame GIF of 7.7 MB took 7 s on the server's prompt thread)."""
    from tokenmill.multimodal.video import MAX_CLIP_FRAMES

    frames = [Image.new("RGB", (1, 1), (i % 2 * 255, 0, 0)) for i in range(MAX_CLIP_FRAMES + 1)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    with pytest.raises(ValueError, match=f"video of {MAX_CLIP_FRAMES + 1} frames"):
        load_video(buf.getvalue(), num_frames=4, max_pixels=1_000_000)


def test_an_image_whose_resize_would_be_huge_is_refused():
    from tokenmill.multimodal.preprocess import ImageProcessor

    proc = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc.max_resized_pixels = 1_000_000
    assert proc([Image.new("RGB", (900, 30))]).shape == (1, 3, 32, 32)  # 960 x 32: fine
    with pytest.raises(ValueError, match="aspect ratio"):
        proc([Image.new("RGB", (40000, 1))])  # 1,280,000 x 32


# ---------------------------------------------------------------- fetching

PNG_BYTES = encode(noise(12, 8))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code: int, length: int | None = None):
        self.send_response(code)
        self.send_header("Content-Type", "image/png")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()

    def _trickle(self, data: bytes, every_s: float = 0.1):
        for i in range(len(data)):
            if self.server.stop.is_set():
                return
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(every_s)

    def do_GET(self):
        try:
            self.route()
        except OSError:  # the client gave up: expected for the slow routes
            pass

    def route(self):
        if self.path == "/img.png":
            self._send(200, len(PNG_BYTES))
            self.wfile.write(PNG_BYTES)
        elif self.path == "/big":
            self._send(200, 10_000)
            self.wfile.write(b"x" * 10_000)
        elif self.path == "/big-unsized":  # no Content-Length: the cap must hold while streaming
            self._send(200)
            for _ in range(100):
                self.wfile.write(b"x" * 1000)
        elif self.path == "/slow-body":
            self._send(200, 1000)
            self._trickle(b"x" * 1000)
        elif self.path == "/slow-headers":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self._trickle(b"X-Slow: " + b"a" * 1000)
        elif self.path in ("/to-file", "/to-ftp"):
            self.send_response(302)
            self.send_header("Location", {"/to-file": "file:///etc/passwd", "/to-ftp": "ftp://127.0.0.1/x"}[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.stop = threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.stop.set()
    srv.shutdown()
    srv.server_close()


def get(url: str, **kw) -> bytes:
    return fetch_url(url, **{"allow_remote": True, "timeout_s": 2.0, "max_bytes": 5000, **kw})


def test_fetch_http_image(server):
    data = get(server + "/img.png")
    assert data == PNG_BYTES
    assert np.array_equal(np.asarray(load_image(data, BIG)), np.asarray(noise(12, 8)))


def test_fetch_remote_refused_when_off(server):
    with pytest.raises(ValueError, match="--mm-allow-remote-urls"):
        get(server + "/img.png", allow_remote=False)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x.png", "gopher://x", "/etc/passwd",
                                 "img.png", "javascript:alert(1)"])
def test_fetch_unsupported_schemes(url):
    for allow in (True, False):
        with pytest.raises(ValueError, match="unsupported URL scheme"):
            fetch_url(url, allow_remote=allow, timeout_s=1, max_bytes=5000)


@pytest.mark.parametrize("path,match", [
    ("/missing.png", "HTTP 404"),
    ("/big", "10000 bytes exceeds the limit of 5000"),
    ("/big-unsized", "exceeds the limit of 5000 bytes"),
    ("/to-file", "not allowed"),  # urllib refuses this one itself
    ("/to-ftp", "refusing a redirect to a non-http"),
])
def test_fetch_errors(server, path, match):
    with pytest.raises(ValueError, match=match):
        get(server + path)


@pytest.mark.parametrize("path", ["/slow-body", "/slow-headers"])
def test_fetch_trickling_server_times_out(server, path):
    start = time.monotonic()
    with pytest.raises(ValueError, match="timed out after 1 s"):
        get(server + path, timeout_s=1.0)
    assert time.monotonic() - start < 4.0  # the trickle lasts 100 s


def test_data_uris():
    assert fetch_url(data_uri(b"hello"), allow_remote=False, timeout_s=1, max_bytes=10) == b"hello"
    assert decode_data_uri("data:,a%20b") == b"a b"  # not base64: percent-encoded
    assert decode_data_uri("DATA:image/png;BASE64,aGk=") == b"hi"
    with pytest.raises(ValueError, match="exceeds the limit of 10 bytes"):
        fetch_url(data_uri(b"x" * 100), allow_remote=False, timeout_s=1, max_bytes=10)
    for bad in ["data:image/png;base64,", "data:image/png;base64,abc", "data:image/png"]:
        with pytest.raises(ValueError, match="bad data URI"):
            decode_data_uri(bad)


# ---------------------------------------------------------------- chat parts

class Recorder:
    def __init__(self):
        self.calls = []

    def image(self, payload):
        self.calls.append(("image", payload))
        return Image.new("RGB", (2, 2), (len(self.calls), 0, 0))

    def video(self, payload):
        self.calls.append(("video", payload))
        return [Image.new("RGB", (2, 2), (0, i, 0)) for i in range(3)]

    def parse(self, messages, limits=None):
        return parse_chat_messages(messages, resolve_image=self.image, resolve_video=self.video,
                                   limits=limits or {"image": 4, "video": 1})


def test_parse_chat_messages_structure():
    rec = Recorder()
    pil = Image.new("RGB", (3, 3))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            {"type": "video_url", "video_url": "https://example.com/v.gif"},
            {"type": "image_url", "image_url": "https://example.com/b.png"},
            {"type": "image", "image": pil},
            {"type": "text", "text": "please."},
        ]},
    ]
    conv, mm = rec.parse(messages)
    assert conv[0] == {"role": "system", "content": "Be brief."}
    assert conv[1]["role"] == "user"
    assert conv[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"},
                                  {"type": "image"}, {"type": "image"}, {"type": "image"},  # the video's 3 frames
                                  {"type": "image"}, {"type": "image"}, {"type": "text", "text": "please."}]
    assert rec.calls == [("image", "data:image/png;base64,AAAA"), ("video", "https://example.com/v.gif"),
                         ("image", "https://example.com/b.png"), ("image", pil)]
    assert [k for k, _ in mm["items"]] == ["image", "video", "image", "image"]
    assert mm["image"] == [m for k, m in mm["items"] if k == "image"] and len(mm["image"]) == 3
    assert mm["video"] == [mm["items"][1][1]] and len(mm["video"][0]) == 3
    assert messages[1]["content"][1]["type"] == "image_url"  # the caller's messages are left as they were


def test_parse_chat_messages_limits():
    rec = Recorder()
    parts = [{"type": "image_url", "image_url": {"url": f"u{i}"}} for i in range(3)]
    with pytest.raises(ValueError, match="at most 2 images per prompt"):
        rec.parse([{"role": "user", "content": parts}], limits={"image": 2})
    assert [p for _, p in rec.calls] == ["u0", "u1"]  # the third is refused before it is fetched
    videos = [{"type": "video", "video": [np.zeros((2, 2, 3), np.uint8)]}] * 2
    with pytest.raises(ValueError, match="at most 1 video per prompt"):
        rec.parse([{"role": "user", "content": videos}])
    with pytest.raises(ValueError, match="at most 0 images"):
        rec.parse([{"role": "user", "content": parts[:1]}], limits={"image": 0})


@pytest.mark.parametrize("part,match", [
    ({"type": "audio_url", "audio_url": {"url": "x"}}, "unsupported content part type 'audio_url'"),
    ({"text": "no type"}, "unsupported content part type None"),
    ({"type": "image"}, "'image' part has no image attached"),
    ({"type": "video"}, "'video' part has no video attached"),
    ({"type": "image_url", "image_url": {}}, r"image_url\.url must be a non-empty string"),
    ({"type": "image_url"}, r"image_url\.url"),
    ({"type": "text", "text": 5}, "text must be a string"),
    ("just a string", "must be an object"),
])
def test_parse_chat_messages_bad_parts(part, match):
    with pytest.raises(ValueError, match=match):
        Recorder().parse([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])


def test_parse_chat_messages_bad_messages():
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        Recorder().parse([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"messages\[1\] must be an object"):
        Recorder().parse([{"role": "user", "content": "hi"}, "oops"])


def test_make_resolvers_end_to_end(server):
    resolve_image, resolve_video = make_resolvers(allow_remote=True, timeout_s=2, max_bytes=100_000,
                                                  max_pixels=10_000, num_frames=2)
    gif = animated_gif(COLORS[:5])
    conv, mm = parse_chat_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": server + "/img.png"}},
        {"type": "image_url", "image_url": {"url": data_uri(PNG_BYTES)}},
        {"type": "video_url", "video_url": {"url": data_uri(gif, "image/gif")}},
        {"type": "image", "image": np.zeros((5, 5, 3), np.uint8)},
        {"type": "video", "video": gif},
    ]}], resolve_image=resolve_image, resolve_video=resolve_video, limits={"image": 3, "video": 2})
    assert len(conv[0]["content"]) == 3 + 2 * 2
    assert [k for k, _ in mm["items"]] == ["image", "image", "video", "image", "video"]
    assert np.array_equal(np.asarray(mm["image"][0]), np.asarray(mm["image"][1]))
    assert [nearest(frame_color(f)) for f in mm["video"][0]] == [0, 4]
    off_image, _ = make_resolvers(allow_remote=False, timeout_s=2, max_bytes=100_000, max_pixels=10_000, num_frames=2)
    with pytest.raises(ValueError, match="--mm-allow-remote-urls"):
        off_image(server + "/img.png")
    small_image, _ = make_resolvers(allow_remote=False, timeout_s=2, max_bytes=10, max_pixels=10_000, num_frames=2)
    with pytest.raises(ValueError, match="exceeds the limit of 10 bytes"):
        small_image(data_uri(PNG_BYTES))
    with pytest.raises(ValueError, match="pixels exceeds the limit"):
        resolve_image(data_uri(encode(Image.new("RGB", (200, 100)))))
