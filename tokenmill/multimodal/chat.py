"""OpenAI-style chat messages with image / video parts -> a conversation for the chat template plus the media.

Parts of a list `content`:
    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:... | http(s)://..."}}   (or "image_url": "<url>")
    {"type": "video_url", "video_url": {"url": ...}}                          (or "video_url": "<url>")
    {"type": "image", "image": <PIL image | array | bytes | url>}             offline (LLM.chat) only
    {"type": "video", "video": <list of frames | array [F,H,W,3] | bytes | url>}

In the conversation each image becomes {"type": "image"} and each video one {"type": "image"} per sampled
frame, which is what LLaVA-style chat templates expand into their image token. The media come back as

    mm_data = {"image": [img, ...],                 # PIL RGB images, in prompt order
               "video": [[frame, ...], ...],        # each video's sampled frames, in prompt order
               "items": [("image", img), ("video", [frame, ...]), ...]}   # both kinds, in prompt order

`items` is the order the template's image placeholders appear in: an image fills one, a video fills
one per frame.
"""
from __future__ import annotations

from typing import Callable

from tokenmill.multimodal.fetch import fetch_url
from tokenmill.multimodal.image import load_image
from tokenmill.multimodal.processor import DEFAULT_LIMITS
from tokenmill.multimodal.video import load_video

_KIND_OF_PART = {"image_url": "image", "image": "image", "video_url": "video", "video": "video"}


def parse_chat_messages(messages: list[dict], *, resolve_image: Callable, resolve_video: Callable,
                        limits: dict[str, int]) -> tuple[list[dict], dict]:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    limits = {**DEFAULT_LIMITS, **(limits or {})}  # kinds the caller leaves out get the config's defaults
    resolvers = {"image": resolve_image, "video": resolve_video}
    mm_data: dict = {"image": [], "video": [], "items": []}
    conversation = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        content = msg.get("content")
        if isinstance(content, list):
            parts = [_convert_part(part, f"messages[{i}].content[{j}]", resolvers, limits, mm_data)
                     for j, part in enumerate(content)]
            msg = {**msg, "content": [p for group in parts for p in group]}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts, "
                             f"got {type(content).__name__}")
        conversation.append(msg)
    return conversation, mm_data


def _convert_part(part, where: str, resolvers: dict, limits: dict, mm_data: dict) -> list[dict]:
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object with a 'type', got {type(part).__name__}")
    ptype = part.get("type")
    if ptype == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text must be a string")
        return [{"type": "text", "text": text}]
    kind = _KIND_OF_PART.get(ptype)
    if kind is None:
        raise ValueError(f"{where}: unsupported content part type {ptype!r} "
                         "(expected text, image_url, video_url, image or video)")
    payload = _payload(part, ptype, where)
    limit = int(limits[kind])
    if len(mm_data[kind]) >= limit:  # refused before fetching or decoding the one over the limit
        raise ValueError(f"at most {limit} {kind}{'s' if limit != 1 else ''} per prompt (--limit-mm-per-prompt)")
    media = resolvers[kind](payload)
    mm_data[kind].append(media)
    mm_data["items"].append((kind, media))
    return [{"type": "image"} for _ in range(len(media) if kind == "video" else 1)]


def _payload(part: dict, ptype: str, where: str):
    value = part.get(ptype)
    if ptype.endswith("_url"):
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.{ptype}.url must be a non-empty string")
        return url
    if value is None:
        raise ValueError(f"{where}: a {ptype!r} part has no {ptype} attached")
    return value


def make_resolvers(allow_remote: bool, timeout_s: float, max_bytes: int, max_pixels: int,
                   num_frames: int) -> tuple[Callable, Callable]:
    """(resolve_image, resolve_video): a URL string is fetched (data: or http(s)) and decoded, anything else
    is loaded as given, each within the server's limits."""
    def fetched(payload):
        if isinstance(payload, str):
            return fetch_url(payload, allow_remote=allow_remote, timeout_s=timeout_s, max_bytes=max_bytes)
        return payload

    def resolve_image(payload):
        return load_image(fetched(payload), max_pixels)

    def resolve_video(payload):
        return load_video(fetched(payload), num_frames, max_pixels)

    return resolve_image, resolve_video
