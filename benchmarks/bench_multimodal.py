"""Multimodal (LLaVA) benchmarks, in one run:

(a) the vision encoder: milliseconds per image of `model.encode_images(pixels)` on a loaded engine's model,
    float (fp32, bf16) against int8 (`w8a8`, weight-only `int8`), at batch 1 and 8 (warm-up, then the median
    of --repeats), with ratios against fp32 at the same batch; and the cosine similarity of each variant's
    encoder output rows to fp32's on the batch's images.
(b) the multimodal ladder (`tokenmill bench ladder --scenario multimodal`): encoder cache, overlap, int8
    encoder, switched on in turn on a random-mm workload.

Shapes: `llava-1.5-7b`, the CLIP ViT-L/14-336 tower (576 tokens per image) and Llama-2-7B widths with dummy
weights, cut to --vision-layers / --text-layers layers (widths kept; recorded); and for (a) the shipped
`tiny-llava` (trained weights) when it is there. Preprocessing CPU time per image is
benchmarks/bench_mm_preprocess.py's.

    python benchmarks/bench_multimodal.py --result-file benchmarks/results/multimodal.json
    python benchmarks/bench_multimodal.py --quick --result-file /tmp/mm_quick.json   # smoke: widths / 16

Writes the result JSON (machine, command, date, encoder rows, the ladder) and the ladder's own file next to it
(<result>.ladder.json, which `tokenmill bench report` reads).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tokenmill  # noqa: E402,F401  before torch (common imports it): tokenmill sets OpenMP's spin-wait first

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAVA = ROOT / "tokenmill" / "assets" / "models" / "tiny-llava"
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14-336 + Llama-2-7B, image token 32000 of a 32064 vocab
LLAVA15_TEXT = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2, pad_token_id=32001)
LLAVA15_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      image_size=336, patch_size=14, hidden_act="quick_gelu", projection_dim=768)
IMAGE_TOKEN_ID = 32000
# llava-hf's layout: the images first, then the text
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
                 "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                 "{% if p['type'] != 'text' %}<image>\n{% endif %}{% endfor %}{% for p in m['content'] %}"
                 "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
                 "{% if m['role'] != 'user' %}{{ eos_token }}{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# (name, engine dtype, mm_encoder_quantization); int8 variants run in --int8-dtype
VARIANTS = (("fp32", "float32", None), ("bf16", "bfloat16", None), ("w8a8", None, "w8a8"), ("int8", None, "int8"))


def write_llava15_dir(path: str, text_layers: int, vision_layers: int, scale: int = 1) -> dict:
    """A config-only LLaVA-1.5-7B-shaped directory (random weights with load_format='dummy'): depth cut to the
    given layers, widths divided by `scale` (1: the real widths), a word-level tokenizer with <image> at
    32000 and a LLaVA chat template, and CLIP-336 preprocessing. Returns the shape recorded in results."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    def narrow(shape: dict, keys) -> dict:
        return {k: v // scale if k in keys else v for k, v in shape.items()}

    text = narrow(dict(LLAVA15_TEXT, num_hidden_layers=text_layers),
                  ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"))
    vision = narrow(dict(LLAVA15_VISION, num_hidden_layers=vision_layers),
                    ("hidden_size", "intermediate_size", "num_attention_heads", "projection_dim"))
    LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=LlamaConfig(**text),
                image_token_index=IMAGE_TOKEN_ID, vision_feature_layer=-2, vision_feature_select_strategy="default",
                projector_hidden_act="gelu", image_seq_length=576,
                architectures=["LlavaForConditionalGeneration"]).save_pretrained(path)
    _write_tokenizer(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 336},
                   "resample": 3, "do_center_crop": True, "crop_size": {"height": 336, "width": 336},
                   "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
                   "image_std": CLIP_STD, "do_convert_rgb": True}, f)
    return {"name": "llava-1.5-7b", "text": text, "vision": vision, "width_divisor": scale, "weights": "dummy"}


def _write_tokenizer(path: str) -> None:
    """Word-level ids 3 .. 31999 ("w3" ...), so random prompt ids decode to text and back to the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, IMAGE_TOKEN_ID)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<image>", "<pad>"])  # 32000, 32001: llava-hf's ids
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<image>"])
    assert fast.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


# -- (a) the encoder --------------------------------------------------------------------------------------
def encoder_rows(shape: dict, model_dir: str, dummy: bool, batches: list[int], repeats: int,
                 int8_dtype: str) -> list[dict]:
    import torch

    from tokenmill import LLM
    from tokenmill.bench.datasets import synthetic_image

    rng = random.Random(0)
    images = [synthetic_image((640, 480), rng) for _ in range(max(batches))]
    rows, reference = [], {}
    for name, dtype, quant in VARIANTS:
        dtype = dtype or int8_dtype
        llm = LLM(model_dir, dtype=dtype, mm_encoder_quantization=quant, load_format="dummy" if dummy else "auto",
                  max_model_len=512, num_kv_blocks=32, max_num_seqs=1, mm_encoder_overlap=False, seed=0)
        model = llm.llm_engine.core.runner.model
        pixels = torch.from_numpy(llm.llm_engine.input_processor.mm.image_processor(images)).to(getattr(torch, dtype))
        for b in batches:
            x = pixels[:b]
            with torch.inference_mode():
                out = model.encode_images(x)  # warm-up: first-call paths, allocator
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    out = model.encode_images(x)
                    times.append(time.perf_counter() - t0)
            out = out.double()  # float32 cannot tell a cosine of 1 - 1e-7 from 1
            if name == "fp32":
                reference[b] = out
            ref = reference[b]
            cos = torch.nn.functional.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
            row = {"shape": shape["name"], "variant": name, "dtype": dtype, "quantization": quant, "batch": b,
                   "ms_per_image": 1e3 * statistics.median(times) / b, "repeats": repeats,
                   "vision_layers_run": len(model.vision_tower.layers),
                   "cosine_vs_fp32_mean": cos.mean().item(), "cosine_vs_fp32_min": cos.min().item(),
                   "rel_l2_error_vs_fp32": ((out - ref).norm() / ref.norm()).item()}
            rows.append(row)
            print(f"[encoder] {shape['name']:<13} {name:<5} batch {b}: {row['ms_per_image']:.1f} ms/image, "
                  f"cosine vs fp32 {row['cosine_vs_fp32_mean']:.6f}", flush=True)
        del llm, model, pixels
        gc.collect()
    for row in rows:  # ratios against fp32 at the same batch, measured in this run
        base = next(r for r in rows if (r["shape"], r["batch"], r["variant"]) == (row["shape"], row["batch"], "fp32"))
        row["speedup_vs_fp32"] = base["ms_per_image"] / row["ms_per_image"]
    return rows


# -- (b) the ladder -----------------------------------------------------------------------------------------
def run_ladder(model_dir: str, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "tokenmill", "bench", "ladder", "--scenario", "multimodal", "--model", model_dir,
           "--load-format", "dummy", "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--mm-num-distinct-images", str(args.num_distinct_images),
           "--max-num-seqs", str(args.max_num_seqs), "--result-file", str(out), *args.extra.split()]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--result-file", required=True)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: widths / 16, 1 text and 2 vision layers, batches 1 and 2, 4 ladder requests")
    ap.add_argument("--text-layers", type=int, default=2, help="language-model layers of the LLaVA-1.5-7B shape")
    ap.add_argument("--vision-layers", type=int, default=24,
                    help="CLIP layers of the LLaVA-1.5-7B shape (the feature layer -2 runs all but the last)")
    ap.add_argument("--batches", default="1,8", help="encoder batch sizes")
    ap.add_argument("--repeats", type=int, default=5, help="timed encoder calls per batch (median)")
    ap.add_argument("--int8-dtype", default="float32", help="engine dtype of the int8 encoder variants")
    ap.add_argument("--skip-encoder", action="store_true")
    ap.add_argument("--skip-ladder", action="store_true")
    g = ap.add_argument_group("ladder")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--num-prompts", type=int, default=16)
    g.add_argument("--request-rate", type=float, default=1.0)
    g.add_argument("--input-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--num-distinct-images", type=int, default=4)
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--extra", default="", help="more `bench ladder` flags, e.g. '--mm-video-fraction 0.25'")
    args = ap.parse_args()
    scale = 1
    if args.quick:
        scale, args.text_layers, args.vision_layers, args.batches, args.repeats = 16, 1, 2, "1,2", 2
        args.num_prompts, args.input_len, args.output_len, args.request_rate = 4, 16, 4, 50.0
    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.result_file)
    result = {"kind": "bench_multimodal", "machine": machine(), "command": " ".join([sys.executable, *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
              "text_layers": args.text_layers, "vision_layers": args.vision_layers}
    with tempfile.TemporaryDirectory(prefix="tokenmill-llava15-") as model_dir:
        shape = write_llava15_dir(model_dir, args.text_layers, args.vision_layers, scale)
        result["shapes"] = [shape]
        if not args.skip_encoder:
            rows = []
            if (TINY_LLAVA / "model.safetensors").is_file():
                result["shapes"].append({"name": "tiny-llava", "path": str(TINY_LLAVA), "weights": "trained"})
                rows += encoder_rows(result["shapes"][-1], str(TINY_LLAVA), False, batches, args.repeats,
                                     args.int8_dtype)
            rows += encoder_rows(shape, model_dir, True, batches, args.repeats, args.int8_dtype)
            result["encoder"] = rows
        if not args.skip_ladder:
            ladder_file = out.with_suffix(".ladder.json")
            ladder = run_ladder(model_dir, ladder_file, args)
            ladder.update(machine=result["machine"], shape=shape, command=result["command"])
            ladder_file.write_text(json.dumps(ladder, indent=2))
            result["ladder"] = ladder
    write_json(result, str(out))


if __name__ == "__main__":
    main()
