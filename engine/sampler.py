"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, seeds, logprobs; logit bias,
penalties and structured-output bitmasks on the rows that use them (engine/logits_processors.py,
engine/structured_output.py).

Sampling inverts each row's cumulative distribution at one uniform draw (on two levels, blocks then tokens, in
float64: each token's chance within about 1e-6 of its share, however small; `sample_from`): one random number per
row, where the exponential race (argmax of p / E, E ~ Exp(1) per vocabulary entry) cost a random draw per entry,
30 ms a step at batch 32 on one CPU thread against 3. A seeded request draws its uniform from its own generator, so
its tokens do not depend on its batch neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_copies import to_host
from engine.logits_processors import LogitBias, Penalties
from engine.request import Request, TokenLogprobs
from engine.structured_output import GrammarCompiler, GrammarMasks


# Past this a temperature flattens the distribution as much as infinity would, and stays finite in float32 (an
# infinite one would turn the -inf of a banned token into NaN).
MAX_TEMPERATURE = 1e4


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors; built once per step from the requests that sample."""

    temperature: torch.Tensor  # [B, 1]; 1.0 for greedy rows (unused there)
    top_k: torch.Tensor | None  # [B] (vocab size = off)
    top_p: torch.Tensor | None  # [B, 1]
    min_p: torch.Tensor | None  # [B, 1]
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked for min_tokens
    generators: list[tuple[int, torch.Generator]]  # seeded rows
    max_logprobs: int | None
    # Built only when some row uses them; None costs the batch nothing.
    logit_bias: LogitBias | None = None
    penalties: Penalties | None = None
    grammar: GrammarMasks | None = None

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device,
                      grammars: GrammarCompiler | None = None) -> "SamplingBatch":
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else min(p.temperature, MAX_TEMPERATURE) for p, g in zip(params, greedy)]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        banned = []
        for row, r in enumerate(requests):
            if r.num_output_tokens < r.sampling_params.min_tokens:
                stop = set(r.stop_ids)
                if not r.sampling_params.ignore_eos:
                    stop |= r.eos_token_ids
                if stop:
                    banned.append((row, sorted(stop)))
        want = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temps, device=device).unsqueeze(1),
            top_k=torch.tensor(top_ks, device=device) if any(k < vocab_size for k in top_ks) else None,
            top_p=torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
            if any(p.top_p < 1.0 for p in params) else None,
            min_p=torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            if any(p.min_p > 0 for p in params) else None,
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            banned=banned,
            generators=[(row, r.generator) for row, r in enumerate(requests) if r.generator is not None],
            max_logprobs=max(want) if want else None,
            logit_bias=LogitBias.build(requests, device) if any(p.logit_bias for p in params) else None,
            penalties=Penalties.build(requests, vocab_size, device) if any(p.has_penalties for p in params) else None,
            grammar=GrammarMasks.build(requests, vocab_size, grammars)
            if any(r.grammar is not None for r in requests) else None,
        )

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from, before temperature (engine/logits_processors.py gives the order)."""
        if self.logit_bias is not None:
            logits = self.logit_bias.apply(logits)
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        for row, ids in self.banned:
            logits[row, ids] = float("-inf")
        if self.grammar is not None:
            self.grammar.apply(logits)
        return logits


class Sampler:
    """native: greedy and plain temperature rows in one native call (engine/kernels/sampling_cpu.cpp) where the
    logits are fp32 on the CPU and no row asks for top-k, top-p or min-p; None: where the kernels load."""

    def __init__(self, native: bool | None = None) -> None:
        self.native = native

    def _use_native(self, logits: torch.Tensor, batch: "SamplingBatch") -> bool:
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            return False
        if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 \
                or logits.stride(1) != 1:
            return False
        if self.native is None:
            from engine.kernels import native_sampler_available
            self.native = native_sampler_available()
        return self.native

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], torch.Tensor | None]:
        """Returns sampled token ids and, when asked for, log-probabilities of the raw logits."""
        tokens, logprobs = self.sample(logits, batch)
        return tokens.tolist(), logprobs

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As __call__, with the token ids left on the logits' device (see sampled_to_host)."""
        logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        logits = batch.process_logits(logits)
        if self._use_native(logits, batch):
            from engine.kernels import sample_rows
            rows = logits.shape[0]
            temperature = batch.temperature.squeeze(1).float().masked_fill(batch.greedy, 0.0)
            uniform = torch.zeros(rows, dtype=torch.float64) if batch.all_greedy else \
                draw_uniforms(rows, batch.generators, logits.device).squeeze(1)
            return sample_rows(logits, temperature.contiguous(), uniform.contiguous()), logprobs
        if batch.all_greedy:
            return logits.argmax(dim=-1), logprobs
        greedy_tokens = logits.argmax(dim=-1) if batch.any_greedy else None
        logits = logits / batch.temperature
        if batch.top_k is not None:
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (batch.top_k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if batch.top_p is not None:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token once the mass before it already reaches top_p (the top token always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= batch.top_p
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        if batch.min_p is not None:
            probs = probs.masked_fill(probs < batch.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        sampled = sample_from(probs, batch.generators)
        if greedy_tokens is None:
            return sampled, logprobs
        return torch.where(batch.greedy, greedy_tokens, sampled), logprobs


# Entries per block of the two-level inversion (sample_from).
CDF_BLOCK = 1024


def sample_from(probs: torch.Tensor, generators: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """One token per row, drawn from the row's (unnormalised, non-negative) weights `probs` [B, V] by inverting its
    cumulative distribution at a uniform draw, on two levels: the row's blocks of `CDF_BLOCK` weights are summed,
    the draw picks a block on their cumulative sums (float64), and lands inside it on the block's own cumulative
    sum (float64), scaled to the block's share of the draw.

    A cumulative sum over the whole vocabulary in float64 was a scalar loop on one CPU thread (an engine replica of
    one CPU runs one): 4.5 ms at batch 16 for SmolLM2's 49,152 entries, a seventh of a decode step, and converting
    the row to float64 for its block sums 1.2 ms more; this takes 0.2 ms. Each token keeps its share of its block
    exactly and each block its float32 sum (within about 1e-6 of the block's weight): no token of positive weight
    becomes undrawable, and none of weight 0 is ever drawn (the draw inside a block stays below the block's total,
    so it lands where the cumulative weight steps up). The clamps keep the index inside the vocabulary for a row
    of NaN weights too, which only NaN logits can give."""
    rows, vocab = probs.shape
    per_row = -(-vocab // CDF_BLOCK)
    padded = probs if per_row * CDF_BLOCK == vocab else torch.nn.functional.pad(probs, (0, per_row * CDF_BLOCK - vocab))
    blocks = padded.view(rows, per_row, CDF_BLOCK)
    block_sums = blocks.sum(dim=-1)
    block_cdf = block_sums.double().cumsum(dim=-1)
    starts = torch.nn.functional.pad(block_cdf, (1, 0))  # where each block's weight begins
    uniform = draw_uniforms(rows, generators, probs.device)
    target = uniform * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=per_row - 1)
    share = (target - starts.gather(1, block)) / block_sums.gather(1, block).double()
    inner = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)
    rest = torch.minimum(share * inner[:, -1:], torch.nextafter(inner[:, -1:], torch.zeros_like(target)))
    index = torch.searchsorted(inner, rest, right=True).clamp_(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + index).squeeze(1).clamp_(max=vocab - 1)


def draw_uniforms(rows: int, generators: list[tuple[int, torch.Generator]], device: torch.device) -> torch.Tensor:
    """[rows, 1] float64 uniforms in [0, 1): torch's default generator's, and a seeded row's from its own generator
    (so that its tokens do not depend on its batch neighbours)."""
    uniform = torch.rand(rows, 1, dtype=torch.float64, device=device)
    for row, generator in generators:
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator).to(device)
    return uniform


def sampled_to_host(tokens: torch.Tensor, logprobs: torch.Tensor | None, rows: list[int],
                    num_top: list[int]) -> tuple[list[int], list[TokenLogprobs]]:
    """The step's one device-to-host copy: every sampled id and, for the rows that asked, the sampled token's
    logprob and its top alternatives, packed into one float64 tensor (exact for ids and fp32 logprobs)."""
    if logprobs is None or not rows:
        return to_host(tokens).tolist(), []
    k = max(num_top)
    row_index = torch.tensor(rows, device=tokens.device)
    parts = [tokens.double(), logprobs[row_index, tokens[row_index]].double()]
    if k:
        top_vals, top_ids = logprobs[row_index].topk(k, dim=-1)
        parts += [top_ids.flatten().double(), top_vals.flatten().double()]
    host = to_host(torch.cat(parts)).tolist()
    b, r = tokens.shape[0], len(rows)
    ids = [int(t) for t in host[:b]]
    chosen = host[b:b + r]
    top_ids, top_vals = host[b + r:b + r + r * k], host[b + r + r * k:]
    out = []
    for i, (row, n) in enumerate(zip(rows, num_top)):
        top = [(int(top_ids[i * k + j]), top_vals[i * k + j]) for j in range(n)]
        out.append(TokenLogprobs(ids[row], chosen[i], top))
    return ids, out
