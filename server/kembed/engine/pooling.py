"""Pooling of hidden states into one vector per row (the per-request normalize / Matryoshka step is the
front end's: ``kembed.frontend.service.postprocess``).

``pool`` runs inside the (possibly compiled) forward: the mode and whether tokens are excluded are
fixed per model, so its only branches are static; nothing depends on the data.
"""

from __future__ import annotations

import torch

from kembed.config.values import Pooling

POOLING_MODES = tuple(mode.value for mode in Pooling if mode is not Pooling.AUTO)


def pool(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mode: str,
    excluded_ids: torch.Tensor | None,
) -> torch.Tensor:
    """float32 [B, H] from hidden [B, L, H] of right-padded rows; not normalized.

    Mean pooling leaves out padding and the configured control tokens (``excluded_ids``) but keeps
    CLS/SEP, as the model was trained. A row with nothing left pools to zeros, never NaN.
    """
    if mode == "mean":
        keep = attention_mask.bool()
        if excluded_ids is not None:
            keep = keep & ~torch.isin(ids, excluded_ids)
        weights = keep.to(torch.float32).unsqueeze(-1)
        total = (hidden.to(torch.float32) * weights).sum(dim=1)
        return total / weights.sum(dim=1).clamp_min(1.0)
    if mode == "cls":
        return hidden[:, 0].to(torch.float32)
    if mode == "last":
        last = (attention_mask.sum(dim=1) - 1).clamp_min(0)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, last].to(torch.float32)
    raise ValueError(f"pooling mode {mode!r} is not one of {POOLING_MODES}")
