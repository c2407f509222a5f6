"""What int8 weights cost in accuracy: the bf16 engine answers a fixed set of chat prompts greedily, then each engine
reads those answers back (teacher forcing, `prompt_logprobs`) and we count how often its top token is the bf16
answer's next token (greedy agreement) and the mean log-probability it gives those tokens.

int8 weights serve steps of up to `engine.kernels.native_int8_max_rows()` rows (8 with AVX512-VNNI, 32 with AVX2:
decode at low and moderate concurrency; larger steps use the bf16 weights), so a quantized engine reads the answers
back in steps of that many tokens (`max_num_batched_tokens`): every token through the int8 weights, as a decode
step would.

    python -m benchmarks.quant_accuracy --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf

bf16 against itself gives 100% and its own mean log-prob: the baseline. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import native_int8_max_rows
from engine.loader import load_model_source, load_tokenizer

PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three prime numbers.", "How do I reverse a list in Python?", "Tell me a short story about a robot.",
    "What causes rain?", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Translate 'good morning' to Spanish.", "What is 17 times 3?", "Describe a cat to someone who has never seen one.",
    "What are the benefits of exercise?", "Summarize the plot of Romeo and Juliet.",
    "How does a computer store numbers?", "Name the planets of the solar system.",
)


@dataclass
class Agreement:
    quantization: str
    step_tokens: int  # the scoring engine's max_num_batched_tokens
    tokens: int
    greedy_agreement: float  # share of the reference's answer tokens that are this engine's top token too
    mean_logprob: float  # of the reference's answer tokens, under this engine


def chat_prompts(model: str, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    tokenizer = load_tokenizer(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for p in prompts]


def score(engine: LLMEngine, prompts: list[list[int]], answers: list[list[int]], label: str) -> Agreement:
    """Reads each prompt + answer back in one prefill; counts the answer tokens only."""
    logprobs: dict[str, list] = {}
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        engine.add_request(f"score-{i}", prompt + answer,
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    while engine.has_unfinished():
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend(out.prompt_logprobs)
    agree, total, sum_logprob = 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        for entry in logprobs[f"score-{i}"][len(prompt) - 1:]:  # entry j is the logprob of token j + 1
            total += 1
            sum_logprob += entry.logprob
            agree += entry.top[0][0] == entry.token_id
    return Agreement(label, engine.config.max_num_batched_tokens, total, agree / max(total, 1),
                     sum_logprob / max(total, 1))


def compare(model: str, prompts: list[list[int]], max_tokens: int, threads: int | None = None,
            quantizations: tuple[str, ...] = ("int8",)) -> list[Agreement]:
    """The bf16 engine's greedy answers, scored under bf16 and under each quantization."""
    source = load_model_source(model)

    def engine(quantization: str | None, budget: int = 2048) -> LLMEngine:
        # No prefix cache: a scored prompt must run through this engine's weights, not hit blocks cached before.
        # The native bf16 kernel at every step size (where oneDNN would take the larger steps) and every row's
        # attention alone (as its decode had it, not in a prompt's query tiles): the reference then scores its own
        # answers exactly, and int8 differs from it by its weights alone.
        return LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, num_threads=threads,
                                      quantization=quantization, max_num_batched_tokens=budget,
                                      native_linear_max_rows=budget, attention_query_tiles=False), source=source)

    reference = engine(None)
    answers = reference.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    results = [score(reference, prompts, answers, "bf16")]
    results += [score(engine(q, native_int8_max_rows()), prompts, answers, q) for q in quantizations]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/quant_accuracy.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = compare(args.model, chat_prompts(args.model), args.max_tokens, args.threads)
    print(f"{'weights':8} {'step tokens':>11} {'tokens':>6} {'greedy agreement':>17} {'mean logprob':>13}")
    for r in results:
        print(f"{r.quantization:8} {r.step_tokens:11d} {r.tokens:6d} {r.greedy_agreement:16.1%} "
              f"{r.mean_logprob:13.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": len(PROMPTS), "max_tokens": args.max_tokens,
                               "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
