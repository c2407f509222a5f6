"""Grammar-constrained decoding with llguidance: grammars compiled off the step loop, one matcher per request.

A request with structured output gets a compile future at add_request; the scheduler leaves it waiting (and
schedules others) until the future is done. Its matcher then accepts every sampled token and fills the row's
next-token bitmask each step. Preemption keeps a request's output tokens, so its matcher stays where it is: the
recomputed prefill samples only the token after them. JSON is written as json.dumps writes it (", " and ": ",
no other whitespace), so a model cannot wander into endless blank space.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling_params import InvalidRequestError, StructuredOutput

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger(__name__)

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED_GRAMMARS = 256


def grammar_spec(spec: StructuredOutput) -> str:
    """The llguidance grammar for a request's structured output; raises InvalidRequestError if it is not one."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if spec.json is not None:
            schema = json.loads(spec.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(ascii_shorthands(spec.regex))
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar or ""))
    except Exception as exc:  # any failure to read a caller's spec (llguidance's converters raise their own types)
        raise InvalidRequestError(f"the structured output spec is not valid: {str(exc):.500}", "response_format",
                                  "invalid_grammar") from exc


_SHORTHANDS = {"d": ("0-9", "digit"), "w": ("0-9A-Za-z_", "word")}


def ascii_shorthands(pattern: str) -> str:
    """`pattern` with `\\d`, `\\w` (and `\\D`, `\\W`) meaning ASCII digits and word characters, as in JSON Schema,
    Outlines and xgrammar. llguidance's regexes follow Unicode, where `\\d` also matches the 700-odd other decimal
    digits (U+1FBF0 is one): a small model asked for `\\d{3}` wanders into them, each several tokens long.
    Inside a class `[...]` they become POSIX classes (`[[:digit:].]`); escaped backslashes stay as they are."""
    out: list[str] = []
    depth = 0  # nesting of character classes (`[a-z&&[^aeiou]]` nests)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e.lower() in _SHORTHANDS:
                chars, posix = _SHORTHANDS[e.lower()]
                negated = "^" if e.isupper() else ""
                out.append(f"[:{negated}{posix}:]" if depth else f"[{negated}{chars}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        close = pattern.find(":]", i + 2) if depth and c == "[" and pattern.startswith(":", i + 1) else -1
        if close > 0:  # a POSIX class inside a class: copied whole
            out.append(pattern[i:close + 2])
            i = close + 2
            continue
        out.append(c)
        i += 1
        if c == "[":
            depth += 1
            for literal in ("^", "]"):  # `[^` negates; a `]` first in a class is a literal
                if pattern.startswith(literal, i):
                    out.append(literal)
                    i += 1
        elif c == "]" and depth:
            depth -= 1
    return "".join(out)


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)  # only valid specs are remembered: a raise is not cached
def check_grammar(spec: StructuredOutput) -> None:
    """Parses the schema, regex or grammar without a tokenizer (~10 ms), so a bad one is refused at the border."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_spec(spec))
    if error:
        raise InvalidRequestError(f"the structured output spec is not valid: {error.splitlines()[0]}",
                                  "response_format")


class GrammarCompiler:
    """Builds matchers on one background thread (llguidance drops the GIL while it builds), cached by spec.

    The tokenizer is loaded on first use, also on that thread: engines that never see structured output never
    pay for it.
    """

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_id: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._tokenizer: Any = None
        self._cache: OrderedDict[StructuredOutput, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Any = None

    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """A future of a fresh matcher's template for this spec (copy it per request with `new_matcher`)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutput) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_spec(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the structured output spec is not valid: {matcher.get_error()}",
                                      "response_format")
        return matcher

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            from engine.loader import load_tokenizer
            hf = load_tokenizer(self.model_path)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            log.info("structured output: llguidance tokenizer ready (%d tokens)", self.vocab_size)
        return self._tokenizer

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """Fills row i of `bitmask` (int32, [rows, ceil(vocab / 32)]) with matcher i's allowed next tokens."""
        import llguidance
        import llguidance.torch

        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=2)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher: waiting for its compile, then following the request's output tokens."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future
        self.matcher: Any = None
        self.num_accepted = 0

    @property
    def ready(self) -> bool:
        """Compiled (or failed: `error` says so); the scheduler leaves a request waiting until then."""
        return self.matcher is not None or self.future.done()

    @property
    def error(self) -> str | None:
        if not self.future.done() or self.future.cancelled():
            return "the grammar compile was cancelled" if self.future.cancelled() else None
        exc = self.future.exception()
        return None if exc is None else str(exc)

    def start(self, output_token_ids: list[int]) -> None:
        """Copies the compiled template; a request that already has output (resumed) replays it."""
        if self.matcher is None:
            self.matcher = self.future.result().deep_copy()
        if self.num_accepted < len(output_token_ids):
            for token in output_token_ids[self.num_accepted:]:
                self.accept(token)

    def accept(self, token: int) -> bool:
        ok = self.matcher.consume_token(token)
        self.num_accepted += 1
        if not ok:
            log.error("a sampled token was refused by its grammar: %s", self.matcher.get_error()[:300])
        return ok

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error())


@dataclass
class GrammarMasks:
    """The allowed next tokens of the batch rows that follow a grammar."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)]; bit j of word w is token 32 * w + j

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, compiler: GrammarCompiler | None) -> "GrammarMasks":
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if compiler is None:
            raise RuntimeError("a request follows a grammar but the engine has no grammar compiler")
        bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        compiler.fill_bitmask([requests[i].grammar.matcher for i in rows], bitmask)
        return cls(rows, bitmask)

    def apply(self, logits: torch.Tensor) -> None:
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((self.bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool().to(logits.device)
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:  # tokens the grammar's tokenizer does not know are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        rows = torch.tensor(self.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
