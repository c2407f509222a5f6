"""Prompts of exact token lengths, and deterministic token blocks for hash ids.

Decoding random token ids and re-encoding the text rarely gives the same ids back: neighbouring pieces merge
(GPT-2: [' calls', 'here'] re-encodes as [' call', 'sh', 'ere']). Prompts are therefore drawn only from
"word" tokens (a leading space or '▁' and ASCII letters) that re-encode to themselves even when repeated:
the pre-tokenizer splits text at each such word, so any sequence of them, and any concatenation of blocks of
them, round-trips exactly. Every prompt is still re-encoded once to check, and fixed up the way
`vllm bench serve` does (truncate or pad, re-encode) if a tokenizer ever disagrees.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MAX_FIXUP_ROUNDS = 10


def word_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of word tokens that re-encode to themselves, each one alone and twice in a row."""
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    candidates = [i for i, p in enumerate(pieces)
                  if p and len(p) > 1 and p[0] in "Ġ▁" and p[1:].isascii() and p[1:].isalpha() and i not in special]
    texts = tokenizer.batch_decode([[i, i] for i in candidates])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = np.array([i for i, e in zip(candidates, encoded) if e == [i, i]], dtype=np.int64)
    if len(ids) < 100:
        raise ValueError(f"the tokenizer has only {len(ids)} round-trip-safe word tokens; it cannot make exact-length "
                         f"prompts (is it a byte-level BPE or SentencePiece tokenizer?)")
    return ids


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int  # tokens of `text` re-encoded without special tokens
    token_ids: tuple[int, ...]


class PromptBuilder:
    """Makes prompt texts from token ids; the same (seed, hash id, block size) always gives the same block."""

    def __init__(self, tokenizer: Any, seed: int = 0, vocab: np.ndarray | None = None) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.vocab = word_token_ids(tokenizer) if vocab is None else vocab
        self._rng = np.random.default_rng(seed)
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def random_tokens(self, n: int) -> list[int]:
        return self.vocab[self._rng.integers(len(self.vocab), size=n)].tolist()

    def block(self, hash_id: int, block_size: int) -> list[int]:
        key = (hash_id, block_size)
        if key not in self._blocks:
            # a hash id's tokens depend on nothing but (seed, hash id, block size), never on request order
            rng = np.random.default_rng([self.seed, int(hash_id < 0), abs(hash_id), block_size])
            self._blocks[key] = self.vocab[rng.integers(len(self.vocab), size=block_size)].tolist()
        return self._blocks[key]

    def hashed_tokens(self, hash_ids: list[int] | tuple[int, ...], num_tokens: int, block_size: int) -> list[int]:
        """`num_tokens` tokens: one block per hash id, the last block cut to what remains (AIPerf's layout)."""
        n = len(hash_ids)
        if not (n - 1) * block_size < num_tokens <= n * block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {n} hash ids of {block_size}-token blocks: the last "
                             f"block must hold 1..{block_size} tokens")
        ids: list[int] = []
        for hash_id in hash_ids:
            ids.extend(self.block(hash_id, block_size)[: num_tokens - len(ids)])
        return ids

    def texts(self, token_lists: list[list[int]]) -> list[Prompt]:
        """Decode each token list and check, by re-encoding, that the text has exactly that many tokens."""
        texts = self.tokenizer.batch_decode(token_lists)
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        prompts = []
        for ids, text, back in zip(token_lists, texts, encoded):
            if back != ids:
                text, back = self._fix_up(back, len(ids))
            prompts.append(Prompt(text, len(back), tuple(back)))
        return prompts

    def text(self, token_ids: list[int]) -> Prompt:
        return self.texts([token_ids])[0]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _fix_up(self, ids: list[int], target: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode(ids)
        for _ in range(MAX_FIXUP_ROUNDS):
            if len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + self.random_tokens(target - len(ids))
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != target:
            log.warning("prompt has %d tokens after re-encoding, not %d", len(ids), target)
        else:
            log.warning("a prompt did not round-trip through the tokenizer; fixed up to %d tokens", target)
        return text, ids
