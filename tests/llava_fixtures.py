"""Tiny random LLaVA models (CLIP tower + Llama or Qwen2 language model) in Hugging Face format, with a
tokenizer that has an `<image>` token and a CLIP preprocessor config, for checking tokenmill against
transformers' LlavaForConditionalGeneration."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image

from conftest import SHAPE, build_tokenizer

IMAGE_TOKEN = 3  # "<image>", a special token of the tokenizer, inside the text vocabulary as in llava-hf
IMAGE_SIZE, PATCH = 16, 4  # 16 patches per image ("default" drops CLS)
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
# content as a string or a list of parts, each image part rendered as its <image> token (llava-hf style)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
                 "{% endif %}")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def llava_config(text: str, feature_layer=-2):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

    text_cfg = (LlamaConfig if text == "llama" else Qwen2Config)(**SHAPE)
    vision = CLIPVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, hidden_act="quick_gelu")
    return LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=IMAGE_TOKEN,
                       vision_feature_layer=feature_layer, vision_feature_select_strategy="default",
                       image_seq_length=TOKENS_PER_IMAGE, architectures=["LlavaForConditionalGeneration"])


def build_llava(path: str, text: str, seed: int = 0, feature_layer=-2):
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config(text, feature_layer)).to(torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights: logits spread out, greedy choices are not near-ties
        for name, p in model.named_parameters():
            if "norm" not in name and "layrnorm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    build_tokenizer(path, extra_specials=("<image>",))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:  # where transformers 5 keeps it
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                   "size": {"shortest_edge": IMAGE_SIZE}, "resample": 3, "do_center_crop": True,
                   "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                   "do_convert_rgb": True}, f)
    return model


def random_image(seed: int, size=(24, 20)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def hf_pixels(path: str, images) -> torch.Tensor:
    from tokenmill.multimodal.preprocess import ImageProcessor

    return torch.from_numpy(ImageProcessor.from_model_dir(path)(images))


def expand(ids: list[int]) -> list[int]:
    """One image token per image -> TOKENS_PER_IMAGE of them (what transformers takes)."""
    out = []
    for t in ids:
        out.extend([t] * TOKENS_PER_IMAGE if t == IMAGE_TOKEN else [t])
    return out


def hf_greedy_mm(model, ids: list[int], pixels: torch.Tensor | None, n: int) -> list[int]:
    kw = {} if pixels is None else {"pixel_values": pixels}
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
                         **kw)
    return out[0, len(ids):].tolist()
