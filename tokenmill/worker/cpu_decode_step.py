"""The CPU's captured decode step: a step of decode rows (one token each: decodes, speculative verification
rows, a draft model's steps) through the whole model in one C call (ops/cpu_decode.c), where the per-op path
makes ~65 Python-level kernel calls. It takes up to 8 rows, or up to 64 where every linear gives its C kernels
that many (bfloat16 on CPUs without a fast bf16 GEMM: layers/linear.py `kernel_rows`). It plays the part CUDA graphs play on a GPU
(worker/cuda_graphs.py), with the same runner interface (`can_run`, `run`), and like them it is off with
`enforce_eager`.

It is built only where the per-op path would run exactly the kernels the driver calls, so that its output
is bit-identical to that path's: a whole Llama-family model (no tensor or pipeline split) in float32 or
bfloat16, the torch attention backend with its C decode kernel, the fused C norm / rotary / SiLU kernels,
and C kernels for the step's rows behind every linear layer (float GEMVs, int8 or AWQ int4). `build`
returns None, and says why in the debug log, everywhere else; those models keep the per-op path.
"""
from __future__ import annotations

import logging

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.ops import cpu_attention, cpu_decode, cpu_fused

logger = logging.getLogger("tokenmill")


def _operands(model, backend: AttentionBackend, kv_caches, block_size: int) -> cpu_decode.DecoderOperands | str:
    """The driver's operands, or why this model cannot take it."""
    from tokenmill.models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a plain Llama-family model"
    if model.shard.tp.size != 1 or not (model.shard.is_first_stage and model.shard.is_last_stage):
        return "the model is split over ranks"
    if type(backend) is not TorchAttentionBackend or backend.use_kernel is False:
        return f"attention backend {type(backend).__name__} has no C decode kernel"
    inner = model.model
    embed = inner.embed_tokens.weight
    dtype = embed.dtype
    if embed.device.type != "cpu" or dtype not in cpu_fused.DTYPES:
        return f"{dtype} weights on {embed.device.type}"
    layers = [inner.layers[i] for i in inner.owned]
    attn = layers[0].self_attn
    q = torch.empty(1, attn.nh, attn.hd, dtype=dtype)
    if not cpu_attention.supports(q, kv_caches[0][0]):
        return "the C decode attention kernel does not take these heads"
    hidden = embed.shape[1]
    intermediate = layers[0].mlp.down_proj.in_features
    row = torch.empty(1, hidden, dtype=dtype)
    norms = [inner.norm.weight] + [w for layer in layers
                                   for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
    rotary = inner.rotary
    # the per-op path takes the fused kernels only under these conditions (layers/norm.py, rotary.py, activation.py)
    if not (cpu_fused.usable(row, *norms) and attn.hd % 32 == 0 and cpu_fused.usable(rotary.cos, rotary.sin)
            and rotary.cos.dtype == dtype and cpu_fused.usable(torch.empty(1, 2 * intermediate, dtype=dtype),
                                                             multiple=32)):
        return "the fused C norm / rotary / SiLU kernels do not take these shapes or dtypes"
    ops = []
    for layer, (k_cache, v_cache) in zip(layers, kv_caches):
        a, mlp = layer.self_attn, layer.mlp
        kernels = [lin.method.decode_rows_kernel(lin) for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(k is None for k in kernels):
            return "a linear layer has no C kernels for decode rows (cpu_linear_kernel 'torch', or its quantization)"
        ops.append(cpu_decode.DecoderLayerOperands(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                                   *kernels, k_cache, v_cache))
    eps = {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)} | {inner.norm.eps}
    if len(eps) != 1:
        return "the norms' eps differ"
    return cpu_decode.DecoderOperands(embed, inner.norm.weight, rotary.cos, rotary.sin, ops, attn.nh, attn.nkv, attn.hd,
                                      intermediate, block_size, eps.pop(), attn.scale)


class CpuDecodeStep:
    def __init__(self, kernel: cpu_decode.DecoderKernel):
        self.kernel = kernel
        # as many rows as every linear's `apply` gives its C kernels (8, or 64 for bf16 on AVX2)
        self.max_rows = min([cpu_decode.max_rows()] + [k.max_rows for lo in kernel.ops.layers
                                                       for k in (lo.qkv, lo.o, lo.gate_up, lo.down)])
        self.steps = self.rows = 0  # decode steps it ran, and their rows (tests and benchmarks read them)

    @classmethod
    def build(cls, model, backend: AttentionBackend, kv_caches, block_size: int) -> "CpuDecodeStep | None":
        if not cpu_decode.available():
            logger.debug("CPU decode step off: its C library is unavailable or disabled")
            return None
        ops = _operands(model, backend, kv_caches, block_size)
        if isinstance(ops, str):
            logger.debug("CPU decode step off: %s", ops)
            return None
        head = model.lm_head.method.decode_rows_kernel(model.lm_head) if model.lm_head is not None else None
        return cls(cpu_decode.DecoderKernel(ops, head))

    def can_run(self, batch: AttentionBatch, num_tokens: int) -> bool:
        """Decode rows only (decodes, verification rows, a draft model's steps), at most max_rows of them."""
        return num_tokens <= self.max_rows and batch.num_decodes == batch.num_seqs == num_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        self.steps += 1
        self.rows += input_ids.shape[0]
        return self.kernel.run(input_ids, positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)

    @property
    def runs_greedy_steps(self) -> bool:
        """Whether `greedy` is available: the LM head has C kernels."""
        return self.kernel.head is not None

    def can_draft(self, batch: AttentionBatch, num_tokens: int, num_requests: int) -> bool:
        """Whether `greedy` takes these rows (as `can_run`) and this many requests (the head's row limit)."""
        return (self.runs_greedy_steps and num_requests <= self.kernel.head.max_rows
                and self.can_run(batch, num_tokens))

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, last: list[int],
               ks: list[int], stops: list[list[int]] | None = None) -> list[list[int]]:
        """Greedy steps in one C call, each argmax the next step's input: the rows first (a draft model's
        catch-ups, or a burst's decodes), request b's first token from row last[b], then single-token steps
        until it has ks[b] (ks descending), or until every request still stepping has made one of its `stops`.
        A draft model's proposals and the target's bursts."""
        tokens = self.kernel.greedy(input_ids, positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                    last, ks, stops)
        self.steps += len(tokens[0])
        self.rows += input_ids.shape[0] + sum(map(len, tokens)) - len(ks)
        return tokens
