"""Incremental detokenization with stop strings that are never emitted, not even in part.

Text is released as soon as it can no longer turn into a stop string: a tail that is a prefix of some stop
string is held back until the next token settles it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt tokens given to the decoder as context, so a first token's leading space decodes as it would mid-text.
CONTEXT_TOKENS = 4


@dataclass
class DetokenizedDelta:
    text: str  # newly released text
    num_tokens: int  # tokens of the input consumed (fewer than given when a stop string ended the text)
    stopped: bool  # a stop string was found; the text ends before it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # the Rust tokenizer behind a HF one
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if prompt_token_ids else None
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stops = [s for s in (stop or []) if s]
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.text = ""  # everything decoded so far, cut at a stop string once one is found
        self._released = 0
        self.stopped = False

    def push(self, token_ids: list[int]) -> DetokenizedDelta:
        consumed = 0
        for token_id in token_ids:
            if self.stopped:
                break
            consumed += 1
            piece = self._stream.step(self._backend, token_id)
            if piece:
                searched_to = len(self.text)
                self.text += piece
                self._cut_at_stop(searched_to)
        return DetokenizedDelta(self._release(final=self.stopped), consumed, self.stopped)

    def flush(self) -> str:
        """The held-back tail, once the sequence ended without completing a stop string."""
        return self._release(final=True)

    def _cut_at_stop(self, searched_to: int) -> None:
        if not self._stops:
            return
        start = max(0, searched_to - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._released)
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for k in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
