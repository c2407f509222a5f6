"""The one border check of a request against an engine: every request-derived index and size, before any state.

An engine replica runs it on every request it receives (`LLMEngine.validate`); the HTTP ingress runs the same
check with the limits its engine replicas report, to refuse early without a hop. Nothing that reaches a step can
then index past the vocabulary, grow past the context or ask for more KV blocks than the pool has.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.sampling_params import MAX_N, InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self, prompt_token_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Raises InvalidRequestError for a request this engine cannot run; `n` choices share the prompt."""
        params.validate()
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n!r:.40}", "n")
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        self.check_token_ids("prompt", prompt_token_ids)
        for name, ids in params.token_id_fields().items():
            self.check_token_ids(name, ids)
        num_prompt, max_tokens = len(prompt_token_ids), params.max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {num_prompt} "
                f"tokens and max_tokens is {max_tokens} ({num_prompt + max_tokens} in all). "
                f"Shorten the prompt or lower max_tokens.", "max_tokens", "context_length_exceeded")
        # The first choice holds the prompt and its output; every other one shares the prompt's full blocks.
        blocks = self.blocks_needed(num_prompt + max_tokens) + (n - 1) * (self.blocks_needed(max_tokens) + 1)
        if blocks > self.num_kv_blocks:
            what = f"{n} choices of max_tokens ({max_tokens})" if n > 1 else f"max_tokens ({max_tokens})"
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) plus {what} needs {blocks} KV blocks and this engine has "
                f"{self.num_kv_blocks}; lower max_tokens{' or n' if n > 1 else ''}, or give the engine more KV "
                f"memory", "max_tokens", "kv_capacity_exceeded")

    def check_token_ids(self, name: str, ids: Iterable[int]) -> None:
        ids = list(ids)
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)):
            return  # the common case, without a Python-level comparison per token
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise InvalidRequestError(f"{name} holds token id {token!r:.40}; token ids must be in "
                                          f"[0, {self.vocab_size})", name, "invalid_token_id")
