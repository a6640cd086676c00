"""Which quantization a model runs with, decided once from the engine option and the checkpoint.

    --quantization  checkpoint's quantization_config   ->  method
    (none)          none                                   float weights
    (none) / awq    awq, bits 4, version gemm              AutoAWQ W4A16 (quantization/awq.py)
    (none) / awq    awq, bits 8, version tokenmill-w8      int8 weight-only (quantization/int8.py)
    int8            none                                   int8 weight-only, made at load time
    w8a8            none                                   int8 weights and per-token int8 activations

Like vLLM, a checkpoint's quantization_config is detected without the flag; a flag that contradicts the
checkpoint is an error, raised before any weight is read.
"""
from __future__ import annotations

from tokenmill.quantization.awq_format import SUPPORTED_GROUP_SIZES, VERSION_W4, VERSION_W8

METHODS = ("int8", "awq", "w8a8")
FROM_FLOAT = ("int8", "w8a8")  # made at load time from a float checkpoint


class QuantizationConfig:
    """Hands each Linear its method; `prefix` is the layer's name in the model."""

    name: str = ""

    def linear_method(self, prefix: str):
        raise NotImplementedError


def checkpoint_quantization(hf_config) -> dict | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return dict(q) if isinstance(q, dict) else q.to_dict()


def resolve_quantization(requested: str | None, hf_config, model_path: str = "") -> str | None:
    """The method name the engine will use; raises ValueError for every mismatch."""
    ckpt = checkpoint_quantization(hf_config)
    if ckpt is None:
        if requested == "awq":
            raise ValueError(f"quantization='awq' needs an AWQ checkpoint, but {model_path or 'the model'} has no "
                             f"quantization_config in config.json; make one with `tokenmill quantize --model "
                             f"{model_path or 'IN'} --output OUT --method awq --bits 4` (or use --quantization int8 "
                             f"to quantize the float weights at load time)")
        return requested
    method = str(ckpt.get("quant_method", "")).lower()
    if method != "awq":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: awq)")
    if requested not in (None, "awq"):
        raise ValueError(f"the checkpoint is AWQ-quantized; quantization={requested!r} needs a float checkpoint")
    awq_settings(ckpt)  # validate now, before any work
    return "awq"


def _setting(ckpt: dict, *keys: str) -> int:
    """The first of `keys` that is set (a null is unset: AutoAWQ's w_bit / q_group_size may stand behind it)."""
    value = next((ckpt[k] for k in keys if ckpt.get(k) is not None), 0)
    try:
        if isinstance(value, bool) or int(value) != float(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"AWQ quantization_config: {keys[0]!r} must be an integer, got {value!r}") from None


def awq_settings(ckpt: dict) -> tuple[int, int, bool, str]:
    bits, group = _setting(ckpt, "bits", "w_bit"), _setting(ckpt, "group_size", "q_group_size")
    zero_point = bool(ckpt.get("zero_point", True))
    version = str(ckpt.get("version", VERSION_W4)).lower()
    if bits == 4:
        if version != VERSION_W4:
            raise ValueError(f"AWQ version {version!r} is not supported for 4-bit (supported: {VERSION_W4!r}, "
                             f"AutoAWQ's GEMM format)")
        if group not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ group_size {group} is not supported (supported: {SUPPORTED_GROUP_SIZES})")
        if not zero_point:
            raise ValueError("AWQ checkpoints without zero points are not supported")
    elif bits == 8:
        if version != VERSION_W8:
            raise ValueError(f"8-bit AWQ needs version {VERSION_W8!r} (tokenmill's format), got {version!r}")
    else:
        raise ValueError(f"AWQ with {bits}-bit weights is not supported (supported: 4, or 8 in tokenmill's format)")
    return bits, group, zero_point, version
