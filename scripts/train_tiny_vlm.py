#!/usr/bin/env python
"""Train tokenmill's tiny vision-language model (tiny-llava) from scratch on synthetic shapes, on CPU.

    python scripts/train_tiny_vlm.py                  # everything (~17 min on 1 CPU thread)
    python scripts/train_tiny_vlm.py --stage eval     # re-evaluate the saved model, rewrite the card

Stages: data (tokenizer, preprocessor config, prompt/tokenizer/pixel checks against
tokenmill/multimodal/synthetic.py), train (a fresh LlavaForConditionalGeneration: tiny CLIP vision tower
+ projector + tiny Llama, all randomly initialised; loss on the answer tokens only), eval (greedy
generation with transformers on the held-out `eval_samples()`, model card). Output:
tokenmill/assets/models/tiny-llava/. Seeded, 1 torch thread by default (--threads), so a rerun on the
same machine reproduces the weights.

Inputs are built without a processor: the prompt text (synthetic.prompt_text, = the chat template) is
tokenized, each `<image>` is expanded to image_seq_length `<image>` ids, and pixel_values holds every
image / video frame of the batch in prompt order, [num_images, 3, S, S], from CLIPImageProcessor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tokenmill.multimodal import synthetic as syn  # noqa: E402

OUT = REPO / "tokenmill" / "assets" / "models" / "tiny-llava"
STATS = OUT / "train_stats.json"  # training figures for the card (eval stage rewrites the card from it)
# One thread by default: on a 2-core machine shared with other work, 2 threads measured 5-10x slower per
# step (threads waiting on each other); the thread count also changes float summation order.
THREADS = 1

# ---- tokenizer: word level over the synthetic vocabulary
SPECIAL = ["<s>", "</s>", "<pad>", "<unk>", syn.IMAGE_TOKEN]  # ids 0..4
BOS, EOS, PAD, UNK, IMAGE = range(5)
PUNCT = [":", "?", ".", ",", "!", "'", "-"]
DIGITS = [str(d) for d in range(10)]
SPARE = ["and", "of", "in", "yes", "no", "colours", "frame", "video", "image", "moves", "an", "color"]
VOCAB_SIZE = 64  # the word list is padded with SPARE words to exactly this (divisible for tensor parallel)
SEQ_LEN = 512
# bos is part of the template (chat prompts are tokenized with add_special_tokens=False). Content is a
# string or a list of parts; image parts become one <image> each; assistant turns end with eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if not loop.first %}{{ ' ' }}{% endif %}"
    "{{ message['role'] + ':' }}"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ ' ' + part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url', 'input_image'] %}{{ ' <image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ ' ' + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ ' assistant:' }}{% endif %}"
)

# ---- model
IMAGE_SIZE, PATCH = 32, 8
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2  # 16 patches (CLS dropped: strategy "default")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
VISION = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=3, hidden_act="quick_gelu",
              layer_norm_eps=1e-5, projection_dim=128)
TEXT = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-5,
            hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False)

# ---- training
TRAIN_TASKS = syn.TASKS  # the 5 one-word tasks + caption, in turn within every batch
VAL_SEED = 4242  # small monitor set during training (not the eval seed either)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_seed(seed: int, step: int) -> int:
    s = seed * 100_000 + step
    assert s not in (syn.EVAL_SEED, VAL_SEED)
    return s


# ----------------------------------------------------------------------------- data stage


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = SPECIAL + PUNCT + DIGITS + [w for w in syn.VOCAB_WORDS if w not in SPECIAL]
    for w in SPARE:
        if len(words) >= VOCAB_SIZE:
            break
        if w not in words:
            words.append(w)
    assert len(words) == len(set(words)) == VOCAB_SIZE, (len(words), VOCAB_SIZE)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    # Joins tokens with spaces; cleanup glues " ." " ?" " ," back onto the word before.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=[syn.IMAGE_TOKEN], model_max_length=SEQ_LEN,
        clean_up_tokenization_spaces=False)


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    tok.save_pretrained(out)
    # A plain, version-neutral tokenizer_config.json with the chat template inline (transformers 5
    # would otherwise write tokenizer_class "TokenizersBackend" and a separate chat_template.jinja).
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "additional_special_tokens": [syn.IMAGE_TOKEN],
        "extra_special_tokens": {"image_token": syn.IMAGE_TOKEN},
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": SEQ_LEN, "clean_up_tokenization_spaces": False,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def preprocessor_config() -> dict:
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_convert_rgb": True,
    }


def numpy_preprocess(img) -> np.ndarray:
    """The same as the CLIP image processor for these square images: PIL bicubic resize, (no-op) crop,
    rescale, normalise, CHW float32. Documented here for engines that do not use transformers."""
    from PIL import Image
    a = np.asarray(img.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC), dtype=np.float32)
    a = a * np.float32(1 / 255)
    return ((a - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)).transpose(2, 0, 1)


def load_processor(path: Path):
    with _quiet():
        return AutoImageProcessor.from_pretrained(path, local_files_only=True)


class _quiet:
    # transformers 5 warns that CLIPImageProcessor falls back to the PIL backend without torchvision.
    def __enter__(self):
        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc):
        hf_logging.set_verbosity(self.level)


def check_tokenizer(path: Path):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (BOS, EOS, PAD, UNK)
    assert tok.convert_tokens_to_ids(syn.IMAGE_TOKEN) == IMAGE
    assert tok("<image> <image>what", add_special_tokens=False)["input_ids"][:2] == [IMAGE, IMAGE]
    assert tok("Red 12?")["input_ids"] == [BOS] + tok.convert_tokens_to_ids(["red", "1", "2", "?"])
    for sample in syn.make_samples(2 * len(syn.TASKS), 1, syn.TASKS):
        chat = tok.apply_chat_template(syn.chat_messages(sample), tokenize=False, add_generation_prompt=True)
        assert chat == syn.prompt_text(sample), (chat, syn.prompt_text(sample))
        ids = tok(chat + " " + sample.answer, add_special_tokens=False)["input_ids"]
        assert UNK not in ids and ids[0] == BOS, ids
        n_img = len(sample.video or sample.images)
        assert ids.count(IMAGE) == n_img
        assert tok.decode(tok(sample.answer, add_special_tokens=False)["input_ids"]) == sample.answer
    s = tok.apply_chat_template([{"role": "user", "content": "what shape is it?"}], tokenize=False,
                                add_generation_prompt=True)
    assert s == "<s>user: what shape is it? assistant:", s
    s = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}],
                                tokenize=False)
    assert s == "<s>user: hi assistant: red </s>", s
    return tok


def check_processor(path: Path) -> None:
    proc = load_processor(path)
    imgs = [im for s in syn.make_samples(12, 2, syn.TASKS) for im in (s.video or s.images)]
    hf = proc(images=imgs, return_tensors="np")["pixel_values"]
    mine = np.stack([numpy_preprocess(im) for im in imgs])
    assert hf.shape == (len(imgs), 3, IMAGE_SIZE, IMAGE_SIZE) and hf.dtype == np.float32
    err = float(np.abs(hf - mine).max())
    assert err < 1e-5, err
    log(f"image processor: {type(proc).__name__}, {hf.shape[1:]} per image; numpy re-implementation "
        f"max |diff| {err:.1e}")


def stage_data() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    save_tokenizer(build_tokenizer(), OUT)
    (OUT / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    tok = check_tokenizer(OUT)
    check_processor(OUT)
    ev = syn.eval_samples()
    tasks = Counter(s.task for s in ev)
    answers = Counter((s.task, s.answer) for s in ev)
    log(f"tokenizer: vocab {len(tok)}, <image> id {IMAGE}; eval set {len(ev)} samples {dict(tasks)}")
    log("eval answers: " + ", ".join(f"{t}/{a} {n}" for (t, a), n in sorted(answers.items())))
    for s in syn.make_samples(len(syn.TASKS), 1, syn.TASKS):
        log(f"  {s.task:8s} {syn.prompt_text(s)!r} -> {s.answer!r}")


# ----------------------------------------------------------------------------- batching


def encode(tok, sample: syn.Sample, with_answer: bool) -> tuple[list[int], list[int]]:
    """(input_ids, labels): the prompt with each <image> expanded to IMAGE_SEQ_LEN ids; labels are -100
    except on the answer and its eos."""
    ids = []
    for t in tok(syn.prompt_text(sample), add_special_tokens=False)["input_ids"]:
        ids += [t] * (IMAGE_SEQ_LEN if t == IMAGE else 1)
    labels = [-100] * len(ids)
    if with_answer:
        ans = tok(sample.answer, add_special_tokens=False)["input_ids"] + [EOS]
        ids, labels = ids + ans, labels + ans
    return ids, labels


def collate(tok, proc, samples: list[syn.Sample]) -> dict[str, torch.Tensor]:
    enc = [encode(tok, s, True) for s in samples]
    width = max(len(i) for i, _ in enc)
    input_ids = torch.full((len(enc), width), PAD, dtype=torch.long)
    labels = torch.full((len(enc), width), -100, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for r, (i, l) in enumerate(enc):
        input_ids[r, :len(i)], labels[r, :len(l)], mask[r, :len(i)] = torch.tensor(i), torch.tensor(l), 1
    images = [im for s in samples for im in (s.video or s.images)]  # prompt order = placeholder order
    pixels = torch.from_numpy(proc(images=images, return_tensors="np")["pixel_values"])
    assert (input_ids == IMAGE).sum() == len(images) * IMAGE_SEQ_LEN
    return dict(input_ids=input_ids, attention_mask=mask, pixel_values=pixels, labels=labels)


# ----------------------------------------------------------------------------- training


def make_config() -> LlavaConfig:
    text = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **TEXT)
    vision = CLIPVisionConfig(**VISION)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                       image_seq_length=IMAGE_SEQ_LEN, projector_hidden_act="gelu",
                       vision_feature_select_strategy="default", vision_feature_layer=-2,
                       tie_word_embeddings=False)


@torch.no_grad()
def first_token_accuracy(model, batch, samples) -> dict[str, float]:
    """Teacher-forced: is the argmax at the first answer position the answer's first token?"""
    model.eval()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    hits: dict[str, list[bool]] = {}
    for r, s in enumerate(samples):
        pos = int((batch["labels"][r] != -100).nonzero()[0])
        hits.setdefault(s.task, []).append(bool(logits[r, pos - 1].argmax() == batch["labels"][r, pos]))
    model.train()
    return {t: sum(h) / len(h) for t, h in hits.items()}


def stage_train(args) -> None:
    tok = AutoTokenizer.from_pretrained(OUT, local_files_only=True)
    proc = load_processor(OUT)
    val_samples = syn.make_samples(6 * 40, VAL_SEED, TRAIN_TASKS)
    val_batch = collate(tok, proc, val_samples)

    torch.manual_seed(args.seed)
    model = LlavaForConditionalGeneration(make_config())
    n_params = sum(p.numel() for p in model.parameters())
    parts = {"vision tower": model.model.vision_tower, "projector": model.model.multi_modal_projector,
             "language model": model.model.language_model, "lm_head": model.lm_head}
    part_params = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    steps, lr = args.steps, args.lr
    warmup, min_lr = max(1, steps // 20), args.lr / 10

    def lr_at(step: int) -> float:  # linear warmup, then cosine down to lr/10
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))

    log(f"{n_params / 1e6:.3f}M params ({', '.join(f'{k} {v:,}' for k, v in part_params.items())}); "
        f"{steps} steps x batch {args.batch_size}, lr {lr}, tasks {TRAIN_TASKS}")
    model.train()
    t0, losses, data_s = time.time(), [], 0.0
    for step in range(steps):
        td = time.time()
        samples = syn.make_samples(args.batch_size, train_seed(args.seed, step), TRAIN_TASKS)
        # Images and videos in separate forward passes (a video prompt is ~2.5x as long: one padded
        # batch would be half padding); the loss is still the mean over the whole batch's answer tokens.
        subs = [collate(tok, proc, group) for group in (
            [s for s in samples if s.video is None], [s for s in samples if s.video is not None]) if group]
        n_targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in subs)
        data_s += time.time() - td
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = 0.0
        for b in subs:
            part = model(**b, num_items_in_batch=n_targets).loss
            part.backward()
            loss += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step == 0:
            el = time.time() - t0
            msg = (f"step {step + 1}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                   f"lr {lr_at(step):.2e} {el / (step + 1):.3f}s/step eta {el / (step + 1) * (steps - step - 1) / 60:.1f}min")
            if (step + 1) % 250 == 0 or step + 1 == steps:
                acc = first_token_accuracy(model, val_batch, val_samples)
                msg += " | val first-token acc " + " ".join(f"{t} {a:.2f}" for t, a in acc.items())
            log(msg)
    train_s = time.time() - t0

    model.eval()
    model.save_pretrained(OUT)
    fix_config(OUT)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(OUT)
    stats = dict(params=n_params, part_params=part_params, steps=steps, batch_size=args.batch_size,
                 lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=0.1, betas=[0.9, 0.95], grad_clip=1.0,
                 seed=args.seed, threads=torch.get_num_threads(), train_tasks=list(TRAIN_TASKS),
                 samples_seen=steps * args.batch_size, train_seconds=round(train_s, 1),
                 data_seconds=round(data_s, 1), final_train_loss=sum(losses[-50:]) / len(losses[-50:]),
                 first_train_loss=losses[0])
    STATS.write_text(json.dumps(stats, indent=2) + "\n")
    log(f"done in {train_s / 60:.1f} min ({data_s / 60:.1f} min making data), saved to {OUT}")


def fix_config(out: Path) -> None:
    cfg = json.loads((out / "config.json").read_text())
    # Keep the classic keys next to transformers 5's: image_token_index (some readers look for
    # image_token_id) and the text model's top-level rope_theta (transformers 5 writes rope_parameters).
    cfg.setdefault("image_token_index", IMAGE)
    tc = cfg["text_config"]
    tc.setdefault("rope_theta", (tc.get("rope_parameters") or {}).get("rope_theta", TEXT["rope_theta"]))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answer(model, tok, proc, sample: syn.Sample, max_new_tokens: int) -> tuple[str, list[int]]:
    ids, _ = encode(tok, sample, with_answer=False)
    images = sample.video or sample.images
    pixels = torch.from_numpy(proc(images=images, return_tensors="np")["pixel_values"])
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                         max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tok.decode(new, skip_special_tokens=True), new


def stage_eval(args) -> None:
    tok = check_tokenizer(OUT)
    check_processor(OUT)
    proc = load_processor(OUT)
    model = LlavaForConditionalGeneration.from_pretrained(OUT, local_files_only=True, dtype=torch.float32).eval()
    cfg = model.config
    assert cfg.image_token_index == IMAGE and cfg.image_seq_length == IMAGE_SEQ_LEN

    t0 = time.time()
    rows: dict[str, list[bool]] = {}
    eos_ok = 0
    examples, confusions = {}, {}
    ev = syn.eval_samples()
    for s in ev:
        text, new = generate_answer(model, tok, proc, s, max_new_tokens=4)
        ok = syn.is_correct(s, text)
        rows.setdefault(s.task, []).append(ok)
        eos_ok += int(ok and len(new) >= 2 and new[1] == EOS)
        examples.setdefault(s.task, (syn.prompt_text(s), s.answer, tok.decode(new)))
        if not ok:
            confusions.setdefault(s.task, Counter())[(s.answer, text)] += 1
    eval_s = time.time() - t0
    # Captions need more than 4 new tokens; scored separately (whole caption must match).
    caps = syn.make_samples(args.caption_eval, syn.EVAL_SEED, ("caption",))
    cap_hits, cap_example = 0, None
    for s in caps:
        text, new = generate_answer(model, tok, proc, s, max_new_tokens=10)
        cap_hits += int(syn.is_correct(s, text) and len(syn.normalize_words(text)) == len(syn.normalize_words(s.answer)))
        cap_example = cap_example or (syn.prompt_text(s), s.answer, tok.decode(new))
    acc = {t: sum(h) / len(h) for t, h in rows.items()}
    overall = sum(sum(h) for h in rows.values()) / len(ev)
    for t, h in rows.items():
        log(f"{t:8s} {sum(h)}/{len(h)} = {acc[t]:.1%}  (chance {1 / len(syn.ANSWERS[t]):.0%})")
    log(f"overall {overall:.1%} of {len(ev)}; answer followed by </s>: {eos_ok}/{len(ev)}; "
        f"captions exact {cap_hits}/{len(caps)}; {eval_s:.1f}s")
    for t, c in confusions.items():
        log(f"  wrong {t}: {dict(c)}")
    summary = dict(acc=acc, counts={t: [sum(h), len(h)] for t, h in rows.items()}, overall=overall,
                   n=len(ev), eos_after_correct=eos_ok, caption_hits=cap_hits, caption_n=len(caps),
                   examples=examples, caption_example=cap_example, eval_seconds=eval_s,
                   confusions={t: {f"{a} -> {g!r}": n for (a, g), n in c.items()} for t, c in confusions.items()})
    write_card(json.loads(STATS.read_text()), summary, cfg)
    log("model card written")


# ----------------------------------------------------------------------------- model card


def threads_words(st: dict) -> str:
    return f"{st['threads']} CPU thread" + ("s" if st["threads"] != 1 else "")


def dir_size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 1e6


def write_card(st: dict, s: dict, cfg) -> None:
    v, t = cfg.vision_config, cfg.text_config
    size_mb = (OUT / "model.safetensors").stat().st_size / 1e6
    pp = st["part_params"]
    task_rows = [
        f"| {task} | {'video (4 frames)' if task in syn.VIDEO_TASKS else 'image'} | {syn.QUESTIONS[task]} | "
        f"{' / '.join(syn.ANSWERS[task])} | {1 / len(syn.ANSWERS[task]):.0%} | "
        f"{s['counts'][task][0]}/{s['counts'][task][1]} | **{s['acc'][task]:.1%}** |"
        for task in syn.ONE_WORD_TASKS]
    ex_lines = []
    for task in syn.ONE_WORD_TASKS:
        prompt, answer, gen = s["examples"][task]
        ex_lines.append(f"| {task} | `{prompt}` | {answer} | `{gen}` |")
    prompt, answer, gen = s["caption_example"]
    ex_lines.append(f"| caption | `{prompt}` | {answer} | `{gen}` |")
    wrong = "; ".join(f"{task}: " + ", ".join(f"{k} x{n}" for k, n in c.items())
                      for task, c in s["confusions"].items()) or "none"
    lines = [
        "---", "library_name: transformers", "pipeline_tag: image-text-to-text", "---", "",
        "# tiny-llava", "",
        f"A {st['params'] / 1e6:.2f}M-parameter LLaVA-architecture (`LlavaForConditionalGeneration`) "
        "vision-language model trained from scratch (no pretrained parts) on synthetic images and 4-frame "
        f"video clips of coloured shapes, on {threads_words(st)}. It answers one-word questions "
        "about colour, shape, count, position and motion, and writes one-line captions. It is a toy for "
        "tokenmill's multimodal tests, benchmarks and examples: it knows nothing outside its synthetic world.",
        "",
        "## Prompt format", "",
        "Chat template (in `tokenizer_config.json`): message content is a string or a list of parts; every "
        "`{\"type\": \"image\"}` part (also `image_url` / `input_image`) becomes one `<image>`. A video is "
        f"given as its {syn.NUM_FRAMES} frames, one image part each.", "",
        "```text",
        "<s>user: <image> what colour is the shape? assistant:",
        "<s>user: <image> <image> <image> <image> which way does the shape move? assistant:",
        "```", "",
        f"Before the model sees it, each `<image>` (id {IMAGE}) is expanded to image_seq_length = "
        f"{IMAGE_SEQ_LEN} `<image>` ids (one per patch), which the projected vision features replace. The "
        "model answers with the word(s) and then `</s>`. Chat prompts are tokenized with "
        "`add_special_tokens=False` (the template writes `<s>`); plain text with `add_special_tokens=True` "
        "gets `<s>` prepended.", "",
        "```jinja", CHAT_TEMPLATE, "```", "",
        "## Data", "",
        "`tokenmill/multimodal/synthetic.py` (numpy + PIL): 64x64 RGB images on a plain white-to-light-grey "
        "background with circles, squares and triangles in red, green, blue or yellow, drawn with "
        "`PIL.ImageDraw`; sizes and positions jittered. Count images have 1-4 shapes in distinct cells of a "
        "2x2 grid (mixed shapes and colours); position/caption images have one shape in the left, right, top "
        "or bottom band; motion clips are 4 frames of one shape moving 7-10 px per frame left, right, up or "
        "down. Every training batch holds all six tasks in turn (5 one-word tasks + caption), freshly "
        f"generated from seed `{st['seed']} * 100000 + step`, so no sample repeats. The eval set "
        f"(`eval_samples()`: {s['n']} samples, {s['n'] // len(syn.ONE_WORD_TASKS)} per task) uses seed "
        f"{syn.EVAL_SEED}, never used in training: it is held out.", "",
        "## Tokenizer", "",
        f"Word level (`tokenizers` WordLevel), vocab {VOCAB_SIZE}: the synthetic vocabulary, digits, "
        "punctuation and a few spare words, lowercase normaliser, whitespace + single-digit pre-tokenizer, "
        "decoder that rejoins words with spaces. Unknown words map to `<unk>`.", "",
        "| id | token | role |", "|---|---|---|",
        "| 0 | `<s>` | bos |", "| 1 | `</s>` | eos (ends every answer) |", "| 2 | `<pad>` | pad |",
        "| 3 | `<unk>` | unknown word |", f"| {IMAGE} | `<image>` | image placeholder (`image_token_index`) |", "",
        "## Image preprocessing", "",
        f"`preprocessor_config.json`: `CLIPImageProcessor`, resize shortest edge to {IMAGE_SIZE} (bicubic), "
        f"center-crop {IMAGE_SIZE}x{IMAGE_SIZE}, rescale 1/255, normalise with CLIP's mean/std: pixel_values "
        f"[num_images, 3, {IMAGE_SIZE}, {IMAGE_SIZE}]. The model was trained on exactly what transformers' "
        "processor gives (its PIL backend, as transformers 5 falls back to without torchvision); "
        "`scripts/train_tiny_vlm.py:numpy_preprocess` is an equivalent numpy version (max difference < 1e-5).",
        "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| vision tower | CLIP ViT (`clip_vision_model`): image {v.image_size}, patch {v.patch_size} -> "
        f"{IMAGE_SEQ_LEN} patches + CLS, hidden {v.hidden_size}, {v.num_hidden_layers} layers, "
        f"{v.num_attention_heads} heads, MLP {v.intermediate_size}, {v.hidden_act}; {pp['vision tower']:,} params |",
        f"| features | `vision_feature_layer` {cfg.vision_feature_layer} (output of layer "
        f"{v.num_hidden_layers - 1} of {v.num_hidden_layers}), strategy `{cfg.vision_feature_select_strategy}` "
        f"(CLS dropped) -> {IMAGE_SEQ_LEN} tokens per image |",
        f"| projector | Linear {v.hidden_size}->{t.hidden_size}, {cfg.projector_hidden_act}, Linear "
        f"{t.hidden_size}->{t.hidden_size}; {pp['projector']:,} params |",
        f"| language model | Llama: hidden {t.hidden_size}, {t.num_hidden_layers} layers, "
        f"{t.num_attention_heads} heads / {t.num_key_value_heads} kv heads (GQA, head_dim "
        f"{t.hidden_size // t.num_attention_heads}), SwiGLU MLP {t.intermediate_size}, RMSNorm, RoPE theta "
        f"{TEXT['rope_theta']:g}, max_position_embeddings {t.max_position_embeddings}; "
        f"{pp['language model']:,} params |",
        f"| lm_head | untied, {t.hidden_size}x{t.vocab_size}; {pp['lm_head']:,} params |",
        f"| total | {st['params']:,} parameters, float32 `model.safetensors` {size_mb:.1f} MB |", "",
        "## Training", "",
        "Command: `python scripts/train_tiny_vlm.py` (stages data, train, eval; `--stage eval` re-evaluates "
        "the saved model and rewrites this card). Everything is trained from random initialisation, jointly.",
        "",
        "| | |", "|---|---|",
        f"| steps | {st['steps']} |",
        f"| batch | {st['batch_size']} samples (all six tasks in turn), right-padded |",
        f"| samples seen | {st['samples_seen']:,} (all distinct) |",
        "| loss | cross-entropy on the answer tokens and their `</s>` only (labels -100 elsewhere) |",
        f"| optimizer | AdamW, betas (0.9, 0.95), weight decay {st['weight_decay']} (not on norms/biases), "
        f"grad clip {st['grad_clip']} |",
        f"| LR schedule | linear warmup {st['warmup']} steps to {st['lr']:g}, cosine to {st['min_lr']:g} |",
        "| precision | float32 |",
        f"| seed | {st['seed']} |",
        f"| training time | {st['train_seconds'] / 60:.1f} min on {threads_words(st)} |",
        f"| train loss | {st['first_train_loss']:.3f} at step 1, {st['final_train_loss']:.4f} (mean of last 50 steps) |",
        "",
        "The learning rate matters: a first attempt with peak LR 2e-3 learned the answer format within 100 "
        "steps and then stayed at chance on every visual task for 1000 steps (the gradients reaching the vision "
        "tower and projector fell to ~1e-3 of their initial norm); at 1e-3 a colour-only probe also stalled, "
        "at 3e-4 it learned colour in ~100 steps.",
        "",
        "## Evaluation", "",
        f"Held-out `eval_samples()` ({s['n']} samples, seed {syn.EVAL_SEED}). Greedy generation with "
        "transformers' `LlavaForConditionalGeneration.generate` (float32, max_new_tokens 4, one sample at a "
        "time); correct = `is_correct`: the first word of the output (lowercased, punctuation removed) is "
        "the answer. Reproduce with `python scripts/train_tiny_vlm.py --stage eval`.", "",
        "| task | input | question | answers | chance | correct | accuracy |",
        "|---|---|---|---|---|---|---|",
        *task_rows,
        f"| **overall** | | | | | {sum(c[0] for c in s['counts'].values())}/{s['n']} | **{s['overall']:.1%}** |",
        "",
        f"Correct answers followed by `</s>` as the next token: {s['eos_after_correct']}/"
        f"{sum(c[0] for c in s['counts'].values())}. Wrong answers (answer -> generated): {wrong}.", "",
        *([f"Shape is the weakest task ({s['acc']['shape']:.0%}): the model sees {IMAGE_SIZE}x{IMAGE_SIZE} "
           "pixels, where the smallest shapes (radius 8 px drawn at 64x64) are 4 px in radius and a circle "
           "and a square differ by a few blurred pixels; most errors are circle/square swaps.", ""]
          if s["acc"]["shape"] < 0.95 else []),
        f"Captions (not in `eval_samples()`; {s['caption_n']} samples from the eval seed with task caption, "
        f"max_new_tokens 10, the whole caption must match): {s['caption_hits']}/{s['caption_n']} = "
        f"{s['caption_hits'] / s['caption_n']:.1%}.", "",
        "Examples (generated text decoded with special tokens):", "",
        "| task | prompt | answer | generated |", "|---|---|---|---|",
        *ex_lines, "",
    ]
    (OUT / "README.md").write_text("\n".join(lines))
    log(f"directory size {dir_size_mb(OUT):.2f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["data", "train", "eval", "all"], default="all")
    ap.add_argument("--steps", type=int, default=2200)
    ap.add_argument("--batch-size", type=int, default=36)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads (at most 2 here)")
    ap.add_argument("--caption-eval", type=int, default=60, help="caption samples scored in the eval stage")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.stage in ("data", "all"):
        stage_data()
    if args.stage in ("train", "all"):
        stage_train(args)
    if args.stage in ("eval", "all"):
        stage_eval(args)


if __name__ == "__main__":
    main()
