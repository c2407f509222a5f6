"""Per-row logit changes batched on the logits' device, each built only when some row of the batch uses it.

Applied in this order, before temperature and the top-k/top-p/min-p filters (vLLM's order):
1. logit_bias: `logits[t] += bias[t]`, each bias clamped to [-100, 100];
2. repetition_penalty `r` (vLLM, after CTRL): for a token in the prompt or the output so far,
   `logits[t] / r` if `logits[t] > 0`, else `logits[t] * r`;
3. frequency and presence penalties (OpenAI): `logits[t] -= frequency * count[t] + presence * (count[t] > 0)`,
   where `count[t]` counts token t in the output so far (not the prompt);
then min_tokens' ban of stop tokens and the structured-output bitmask set tokens to -inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class LogitBias:
    rows: torch.Tensor  # [N] batch row of each entry
    token_ids: torch.Tensor  # [N]
    values: torch.Tensor  # [N]

    @classmethod
    def build(cls, requests: list[Request], device: torch.device) -> "LogitBias | None":
        rows, ids, values = [], [], []
        for row, r in enumerate(requests):
            for token, bias in r.sampling_params.clamped_logit_bias().items():
                rows.append(row)
                ids.append(token)
                values.append(bias)
        if not rows:
            return None
        return cls(torch.tensor(rows, device=device), torch.tensor(ids, device=device),
                   torch.tensor(values, device=device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.token_ids), self.values.to(logits.dtype), accumulate=True)


@dataclass
class Penalties:
    rows: torch.Tensor  # [R] batch rows with a penalty
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repetition: torch.Tensor | None  # [R, 1]; None when every row's is 1
    output_counts: torch.Tensor  # [R, V] occurrences of each token in the output so far
    seen: torch.Tensor | None  # [R, V] bool: in the prompt or the output (repetition only)

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device) -> "Penalties | None":
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not rows:
            return None
        params = [requests[i].sampling_params for i in rows]
        outputs = [requests[i].output_token_ids for i in rows]
        counts = _bincount_rows(outputs, vocab_size, device)
        repetition = seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
            seen = (_bincount_rows([requests[i].prompt_token_ids for i in rows], vocab_size, device) > 0) | (counts > 0)
        return cls(rows=torch.tensor(rows, device=device),
                   presence=torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1),
                   frequency=torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1),
                   repetition=repetition, output_counts=counts, seen=seen)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        sub = logits[self.rows].float()
        if self.repetition is not None:
            scaled = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(self.seen, scaled, sub)
        sub = sub - self.frequency * self.output_counts - self.presence * (self.output_counts > 0).float()
        logits[self.rows] = sub.to(logits.dtype)
        return logits


def _bincount_rows(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] float counts, one scatter for all rows."""
    longest = max((len(t) for t in token_lists), default=0)
    if longest == 0:
        return torch.zeros(len(token_lists), vocab_size, device=device)
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    # One spare column takes the padding, then is dropped.
    spare = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    spare.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return spare[:, :vocab_size]
