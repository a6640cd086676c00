"""ctypes binding of ops/cpu_decode.c: a decode step of up to `max_rows()` rows (one token each) through
the whole decoder in one C call.

`DecoderKernel` is built once from plain operands (weights, norms, caches, shapes) and then run per step
with pointers to that step's input tensors. The C driver calls the same kernels, in the same order, as
the per-op path of models/llama.py, which is its twin (their hidden states are bit-identical).
`TOKENMILL_DISABLE_CPU_DECODE=1` turns it off.
"""
from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass
from functools import lru_cache

import torch

from tokenmill.layers.linear import DecodeRowsKernel
from tokenmill.ops import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
LINEAR_KINDS = {"f32": 0, "bf16": 1, "s8": 2, "u4": 3}  # as the enum in cpu_decode.c


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("group", _I),
                ("w", _P), ("scales", _P), ("zeros", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("key_cache", _P), ("value_cache", _P)]


class _Decoder(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("block_size", _I), ("bf16", _I), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("embed", _P), ("final_norm", _P), ("cos", _P), ("sin", _P),
                ("layers", ctypes.POINTER(_Layer)), ("scratch", _P)]


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_decode.c", "TOKENMILL_DISABLE_CPU_DECODE",
                      links=("cpu_gemv.c", "cpu_qgemv.c", "cpu_fused.c", "cpu_attention.c"))
    if lib is None:
        return None
    lib.tm_decode_scratch_elems.argtypes = [ctypes.POINTER(_Decoder)]
    lib.tm_decode_scratch_elems.restype = _I
    lib.tm_decode_rows.argtypes = [ctypes.POINTER(_Decoder), _I, _P, _P, _P, _P, _I, _P, _P, ctypes.c_int]
    lib.tm_decode_rows.restype = None
    lib.tm_decode_max_rows.restype = _I
    lib.tm_decode_greedy.argtypes = [ctypes.POINTER(_Decoder), ctypes.POINTER(_Linear), _I, _P, _P, _P, _P, _I, _P,
                                     _I, _P, _P, _I, _P, _P, _P, _P, _I, ctypes.c_int]
    lib.tm_decode_greedy.restype = _I
    return lib


def available() -> bool:
    return _library() is not None


def max_rows() -> int:
    return _library().tm_decode_max_rows()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class DecoderLayerOperands:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: DecodeRowsKernel
    o: DecodeRowsKernel
    gate_up: DecodeRowsKernel
    down: DecodeRowsKernel
    key_cache: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor


@dataclass
class DecoderOperands:
    embed: torch.Tensor        # [vocab, hidden]
    final_norm: torch.Tensor
    cos: torch.Tensor          # [max_positions, head_dim]
    sin: torch.Tensor
    layers: list[DecoderLayerOperands]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    eps: float
    scale: float


def _linear(k: DecodeRowsKernel) -> _Linear:
    return _Linear(LINEAR_KINDS[k.kind], k.out_features, k.in_features, k.group_size, _ptr(k.weight),
                   _ptr(k.scales), _ptr(k.zeros), _ptr(k.bias))


class DecoderKernel:
    """Holds the operands (so their memory outlives every call) and the C structs pointing at them."""

    def __init__(self, ops: DecoderOperands, head: DecodeRowsKernel | None = None):
        self.ops = ops
        self.head = head  # the LM head's C kernels (for `greedy`); held here so its tensors outlive every call
        dtype = ops.embed.dtype
        self.hidden = ops.embed.shape[1]
        layers = (_Layer * len(ops.layers))(*[
            _Layer(_ptr(lo.input_norm), _ptr(lo.post_norm), _linear(lo.qkv), _linear(lo.o), _linear(lo.gate_up),
                   _linear(lo.down), _ptr(lo.key_cache), _ptr(lo.value_cache)) for lo in ops.layers])
        self._layers = layers
        self.decoder = _Decoder(len(ops.layers), self.hidden, ops.num_heads, ops.num_kv_heads, ops.head_dim,
                                ops.intermediate, ops.block_size, int(dtype == torch.bfloat16), ops.eps, ops.scale,
                                _ptr(ops.embed), _ptr(ops.final_norm), _ptr(ops.cos), _ptr(ops.sin), layers, None)
        lib = _library()
        self.scratch = torch.empty(lib.tm_decode_scratch_elems(ctypes.byref(self.decoder)), dtype=dtype)
        self.decoder.scratch = self.scratch.data_ptr()
        self.out = torch.empty(max_rows(), self.hidden, dtype=dtype)
        self._ref = ctypes.byref(self.decoder)
        self._fn = lib.tm_decode_rows
        self._head = _linear(head) if head is not None else None
        self._head_ref = ctypes.byref(self._head) if head is not None else None
        self._drafts, self._logits = torch.empty(0, dtype=torch.int64), None  # `greedy`'s outputs, reused

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor) -> torch.Tensor:
        """B rows: int64 tokens / positions / slots [B], int32 block tables [B, width] (rows contiguous) and
        seq_lens [B] -> the final hidden states [B, hidden], a view of a buffer the next call overwrites."""
        b = tokens.shape[0]
        self._fn(self._ref, b, tokens.data_ptr(), positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                 block_tables.stride(0), seq_lens.data_ptr(), self.out.data_ptr(), torch.get_num_threads())
        return self.out[:b]

    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, last: list[int], ks: list[int],
               stops: list[list[int]] | None = None) -> list[list[int]]:
        """Greedy steps in one call (cpu_decode.c tm_decode_greedy): the rows as `run` takes them, then request
        b's ks[b] tokens, its first from row last[b]; ks descending, len(last) <= head.max_rows. With `stops`
        (request b's stop tokens), the steps end once every request still stepping has made one of its own:
        a request then gets fewer than ks[b] tokens, the last of them a stop."""
        b, kmax = len(last), ks[0]
        if self._drafts.numel() < b * kmax:
            self._drafts = torch.empty(2 * b * kmax, dtype=torch.int64)
        if self._logits is None:  # made on first use: only a head that runs greedy steps needs it
            self._logits = torch.empty(self.head.max_rows, self.head.out_features, dtype=self.out.dtype)
        idx = torch.frombuffer(array("q", last + ks), dtype=torch.int64)
        nstop = max(map(len, stops)) if stops else 0
        stop_ids = (torch.frombuffer(array("q", [t for st in stops for t in st + [-1] * (nstop - len(st))]),
                                     dtype=torch.int64) if nstop else None)
        ran = _library().tm_decode_greedy(
            self._ref, self._head_ref, tokens.shape[0], tokens.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), b, idx.data_ptr(),
            idx.data_ptr() + 8 * b, kmax, self._drafts.data_ptr(), self.out.data_ptr(), self._logits.data_ptr(),
            stop_ids.data_ptr() if nstop else None, nstop, torch.get_num_threads())
        ks = [min(k, ran) for k in ks]
        return [row[:k] for row, k in zip(self._drafts[:b * kmax].view(b, kmax).tolist(), ks)]
