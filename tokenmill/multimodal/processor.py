"""Prompt + images -> token ids with every image's placeholders expanded, and one MultiModalItem per image
or video frame (preprocessed pixels, content hash, placeholder span). Runs on the input side (the API
process when serving), so the engine core only ever sees plain ids and pixels.

    "USER: <image> what colour? ASSISTANT:"  + 1 image  ->  ids [.., IMG x T, ..], item(offset, T)
    "USER: <video> which way?"               + 1 clip of F frames -> F images: [.., IMG x T, IMG x T, ..]

A prompt names each image with one image token; a video with `<video>` in text prompts (each sampled frame
becomes an image). Media come as vLLM's `multi_modal_data` ({"image": one or a list, "video": one clip or a
list of clips}); token-id prompts take images first, then video frames, in order. The chat path hands an
ordered list instead (`"items"`: [("image", img) | ("video", frames)]), from multimodal/chat.py.
"""
from __future__ import annotations

import json
import re

import numpy as np

from tokenmill.multimodal.inputs import MultiModalItem

DEFAULT_LIMITS = {"image": 4, "video": 1}
VIDEO_MARKER = "<video>"


def parse_limits(spec) -> dict[str, int]:
    """`limit_mm_per_prompt` as a dict or JSON text -> {"image": n, "video": m}."""
    if spec is None or spec == "":
        return dict(DEFAULT_LIMITS)
    try:
        value = json.loads(spec) if isinstance(spec, str) else dict(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"limit_mm_per_prompt is not a JSON object ({e}): {spec!r}") from None
    if not isinstance(value, dict) or any(k not in DEFAULT_LIMITS or not isinstance(v, int) or v < 0
                                          for k, v in value.items()):
        raise ValueError(f"limit_mm_per_prompt must map 'image' / 'video' to counts >= 0, got {spec!r}")
    return {**DEFAULT_LIMITS, **value}


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class MultiModalProcessor:
    def __init__(self, image_token_id: int, tokens_per_image: int, image_size: int, model_dir: str, tokenizer,
                 limits: dict[str, int], max_pixels: int, num_frames: int):
        from tokenmill.multimodal.preprocess import ImageProcessor

        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image
        self.limits, self.max_pixels, self.num_frames = limits, max_pixels, num_frames
        self.image_processor = ImageProcessor.from_model_dir(model_dir)
        self.image_processor.max_resized_pixels = max_pixels  # a 1 x 1,000,000 image would resize to 32M pixels
        self.image_marker = tokenizer.convert_ids_to_tokens(image_token_id) if tokenizer is not None else "<image>"
        self.image_size = image_size

    @classmethod
    def from_config(cls, config, model_config, tokenizer) -> "MultiModalProcessor":
        vision = model_config.hf_config.vision_config
        return cls(model_config.image_token_id, model_config.mm_tokens_per_image, vision.image_size,
                   config.model, tokenizer, parse_limits(config.limit_mm_per_prompt), config.mm_max_image_pixels,
                   config.mm_video_num_frames)

    # -- media, in placeholder order ---------------------------------------------------------------------
    def prepare(self, prompt, mm_data) -> tuple[object, list[tuple[str, object]]]:
        """The prompt (a text prompt's video markers expanded to one image marker per frame) and the media
        of each image placeholder in order, as (modality, image). Counts are checked against the limits."""
        if not mm_data:
            return prompt, []
        if not isinstance(mm_data, dict):
            raise ValueError("'multi_modal_data' must be a dict like {'image': ..., 'video': ...}")
        unknown = set(mm_data) - {"image", "video", "items"}
        if unknown:
            raise ValueError(f"unsupported multi_modal_data key(s): {', '.join(sorted(unknown))}; "
                             f"supported: image, video")
        if "items" in mm_data:
            media = [(kind, x) for kind, x in mm_data["items"]]
        else:
            media = [("image", x) for x in _as_list(mm_data.get("image", []))] + \
                    [("video", x) for x in self._clips(mm_data.get("video"))]
        self._check_limits(media)
        loaded = [(kind, self._load(kind, x)) for kind, x in media]
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            text, ordered = self._order_by_markers(text, loaded)
            prompt = {**prompt, "prompt": text} if isinstance(prompt, dict) else text
            return prompt, ordered
        return prompt, [(kind, frame) for kind, x in loaded for frame in (x if kind == "video" else [x])]

    @staticmethod
    def _clips(video) -> list:
        if video is None:
            return []
        # one clip is a list of frames or an array [F, H, W, 3]; several clips are a list of those
        if isinstance(video, np.ndarray) and video.ndim == 4 or isinstance(video, (bytes, str)):
            return [video]
        if isinstance(video, (list, tuple)) and video and isinstance(video[0], (list, tuple)):
            return list(video)
        if isinstance(video, (list, tuple)) and video and isinstance(video[0], np.ndarray) and video[0].ndim == 4:
            return list(video)
        return [video]

    def _check_limits(self, media) -> None:
        for kind, limit in self.limits.items():
            count = sum(1 for k, _ in media if k == kind)
            if count > limit:
                raise ValueError(f"at most {limit} {kind}{'s' if limit != 1 else ''} per prompt "
                                 f"(limit_mm_per_prompt), got {count}")

    def _load(self, kind: str, x):
        from tokenmill.multimodal.image import load_image
        from tokenmill.multimodal.video import load_video

        if kind == "video":  # frames the chat path sampled already come back unchanged (no more than num_frames)
            return load_video(x, self.num_frames, self.max_pixels)
        return load_image(x, self.max_pixels)

    def _order_by_markers(self, text: str, loaded) -> tuple[str, list[tuple[str, object]]]:
        images = [x for k, x in loaded if k == "image"]
        videos = [x for k, x in loaded if k == "video"]
        markers = re.findall(re.escape(self.image_marker) + "|" + re.escape(VIDEO_MARKER), text)
        n_img, n_vid = markers.count(self.image_marker), markers.count(VIDEO_MARKER)
        if n_img != len(images) or n_vid != len(videos):
            raise ValueError(f"the prompt has {n_img} {self.image_marker} and {n_vid} {VIDEO_MARKER} placeholder(s) "
                             f"but {len(images)} image(s) and {len(videos)} video(s) were given")
        ordered, it_img, it_vid = [], iter(images), iter(videos)
        for m in markers:
            if m == self.image_marker:
                ordered.append(("image", next(it_img)))
            else:
                ordered.extend(("video", f) for f in next(it_vid))
        frames = iter(len(v) for v in videos)
        text = re.sub(re.escape(VIDEO_MARKER), lambda _: self.image_marker * next(frames), text)
        return text, ordered

    # -- token ids --------------------------------------------------------------------------------------
    def expand(self, ids: list[int], ordered) -> tuple[list[int], list[MultiModalItem]]:
        """Each image token becomes tokens_per_image of them (ids already expanded are accepted as they
        are); one item per image with its pixels and span. The count must match the media exactly."""
        out, starts = self.expand_ids(ids, len(ordered))
        pixels = self.image_processor([x for _, x in ordered]) if ordered else []
        return out, [MultiModalItem.from_pixels(kind, px, start, self.tokens_per_image)
                     for (kind, _), px, start in zip(ordered, pixels, starts)]

    def expand_ids(self, ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """The ids the engine runs for `num_images` images (or video frames): each placeholder as
        tokens_per_image tokens; and where each image's tokens start."""
        t, img = self.tokens_per_image, self.image_token_id
        places = [i for i, x in enumerate(ids) if x == img]
        if not places and not num_images:
            return ids, []
        expanded = len(places) == t * num_images and all(
            places[k * t + t - 1] - places[k * t] == t - 1 for k in range(num_images))
        if not expanded and len(places) != num_images:
            raise ValueError(f"the prompt has {len(places)} image placeholder token(s) but {num_images} image(s) "
                             f"or video frame(s) were given")
        out, starts, prev = [], [], 0
        for p in places[::t] if expanded else places:
            out.extend(ids[prev:p])
            starts.append(len(out))
            out.extend([img] * t)
            prev = p + (t if expanded else 1)
        out.extend(ids[prev:])
        return out, starts

