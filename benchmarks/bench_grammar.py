"""xgrammar against llguidance on this CPU: compile time, per-token mask time and correctness.

For each schema, each library compiles the grammar against the model's tokenizer (cold: a fresh compiler, no
cache), then walks two token paths while filling the next-token bitmask at every step: the tokens of a valid
document (every one of them must be allowed), and a random walk that picks uniformly among allowed tokens until
the grammar terminates (the text must parse and validate against the schema; walks cut at 200 tokens are
left out). Writes JSON; prints a table.

    python -m benchmarks.bench_grammar --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadtests.metrics import percentile

log = logging.getLogger(__name__)

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "zip": {"type": "integer"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
    "in_stock": {"type": "boolean"}}, "required": ["colour", "size", "in_stock"], "additionalProperties": False}
ARRAYS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
    "required": ["tags", "scores"], "additionalProperties": False}
NUM_WALKS = 20
SCHEMAS = {"nested": (NESTED, {"name": "Ada", "address": {"city": "Paris", "zip": 75001}}),
           "enums": (ENUMS, {"colour": "green", "size": "XL", "in_stock": True}),
           "arrays": (ARRAYS, {"tags": ["a", "bb"], "scores": [1.5, -2]}),
           "any_json": (None, {"k": [1, {"x": None}], "s": "t"})}


# Both libraries set to one layout: no free whitespace, separators as json.dumps writes them.
LLGUIDANCE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop: list[int]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)

    def compile(self, schema: dict | None) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, vocab_size: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop[0])

    def compile(self, schema: dict | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=LLGUIDANCE_JSON)
        self.llg.LLMatcher(self.tokenizer, grammar)  # the work happens here: lexer built for this tokenizer
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, vocab_size: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(1, vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


def allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def walk(lib: Any, compiled: Any, tokens: list[int] | None, vocab_size: int, stop: list[int],
         rng: random.Random, max_steps: int = 200) -> tuple[list[float], list[int], bool]:
    """Mask times, the tokens taken, and whether every given token was allowed."""
    matcher, bitmask = lib.matcher(compiled), lib.bitmask(vocab_size)
    times, taken, ok = [], [], True
    for step in range(max_steps):
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask)
        times.append(time.perf_counter() - t0)
        options = allowed(bitmask, vocab_size)
        if tokens is not None:
            token = tokens[step] if step < len(tokens) else stop[0]
            ok = ok and token in options
        else:
            non_stop = [t for t in options if t not in stop]
            token = rng.choice(non_stop) if non_stop and (step < 60 or stop[0] not in options) else stop[0]
        if not lib.accept(matcher, token):
            return times, taken, False
        taken.append(token)
        if lib.done(matcher):
            break
    return times, taken, ok and lib.done(matcher)


def measure(lib: Any, tokenizer: Any, vocab_size: int, stop: list[int]) -> dict[str, Any]:
    import jsonschema
    rng = random.Random(0)
    out: dict[str, Any] = {}
    for name, (schema, example) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        compile_s = time.perf_counter() - t0
        doc_tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False)
        times, _, valid_doc_ok = walk(lib, compiled, doc_tokens, vocab_size, stop, rng)
        random_ok, random_cut, random_times = 0, 0, []
        for _ in range(NUM_WALKS):
            t, taken, finished = walk(lib, compiled, None, vocab_size, stop, rng)
            random_times += t
            text = tokenizer.decode([x for x in taken if x not in stop])
            if not finished:  # an unbounded string the walk never closed: cut at max_steps, not wrong
                random_cut += 1
                continue
            try:
                value = json.loads(text)
                if schema is not None:
                    jsonschema.validate(value, schema)
                random_ok += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                log.warning("%s %s: invalid random walk %r: %s", lib.name, name, text[:200], exc)
        all_times = times + random_times
        out[name] = {"compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(all_times) * 1e6,
                     "mask_us_p99": percentile(all_times, 0.99) * 1e6,
                     "valid_document_accepted": valid_doc_ok,
                     "random_walks_valid": f"{random_ok}/{NUM_WALKS - random_cut}"}
    return out


def main() -> None:
    from engine.loader import load_tokenizer
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="results/bench_grammar.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    vocab_size, stop = len(tokenizer), [tokenizer.eos_token_id]
    results = {}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tokenizer, vocab_size, stop)
        setup_ms = (time.perf_counter() - t0) * 1e3
        results[cls.name] = {"tokenizer_setup_ms": setup_ms, "schemas": measure(lib, tokenizer, vocab_size, stop)}
    lines = [f"vocabulary {vocab_size}; 1 torch thread", f"{'library':11} {'schema':9} {'compile ms':>10} "
             f"{'mask µs p50':>11} {'p99':>7} {'doc ok':>6} {'random ok':>9}"]
    for lib, r in results.items():
        lines.append(f"{lib:11} {'(tokenizer setup)':20} {r['tokenizer_setup_ms']:.0f} ms")
        for name, s in r["schemas"].items():
            lines.append(f"{lib:11} {name:9} {s['compile_ms']:10.1f} {s['mask_us_median']:11.0f} "
                         f"{s['mask_us_p99']:7.0f} {str(s['valid_document_accepted']):>6} {s['random_walks_valid']:>9}")
    log.info("\n%s", "\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
