"""Windowed perplexity, shared by the model cards, scripts/eval_ppl_hf.py and the engine.

Pure functions with no dependency on the rest of tokenmill: the caller supplies a
``logits_fn`` (transformers, the tokenmill engine, a unigram table, ...), so every
backend is scored on exactly the same positions and the numbers are comparable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

LogitsFn = Callable[[list[int]], torch.Tensor]


def iter_windows(token_ids: Sequence[int], window: int, bos_id: int | None) -> list[list[int]]:
    """Consecutive non-overlapping windows of at most ``window`` ids.

    With ``bos_id`` each window is ``[bos] + chunk`` and bos counts towards the window
    length, so every input token is scored (bos predicts the first one). Without bos
    the first token of each window has no context and is not scored.
    """
    step = window - 1 if bos_id is not None else window
    if step < 1:
        raise ValueError(f"window={window} is too small (bos_id={bos_id})")
    prefix = [bos_id] if bos_id is not None else []
    return [prefix + list(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]


def perplexity(
    logits_fn: LogitsFn, token_ids: list[int], window: int, bos_id: int | None = None
) -> dict:
    """Mean next-token NLL of ``token_ids`` under ``logits_fn``, window by window.

    ``logits_fn(window_ids)`` must return float logits of shape ``[len(window_ids), vocab]``
    where row ``i`` scores the token at position ``i + 1``. NLL is accumulated in float64.
    Returns ``{"ppl": exp(mean_nll), "nll": mean_nll, "tokens": scored_positions}``.
    """
    total_nll = 0.0
    count = 0
    for ids in iter_windows(token_ids, window, bos_id):
        if len(ids) < 2:  # a lone token (no bos) has no target inside its window
            continue
        logits = logits_fn(ids)
        if logits.dim() != 2 or logits.shape[0] != len(ids):
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for {len(ids)} ids")
        logprobs = torch.log_softmax(logits[:-1].to(torch.float64), dim=-1)
        targets = torch.tensor(ids[1:], dtype=torch.long, device=logprobs.device)
        total_nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(ids) - 1
    if count == 0:
        raise ValueError("no positions to score")
    nll = total_nll / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count}
