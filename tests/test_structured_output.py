"""Structured output in the engine (SmolLM2): outputs follow their grammar, greedy or sampled, through
preemption; a request whose grammar compiles does not hold the batch; prompt logprobs match transformers."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_model_source, load_tokenizer
from engine.sampling_params import InvalidRequestError, StructuredOutput
from engine.structured_output import GrammarCompiler, ascii_shorthands
from tests.tiny_models import write_tiny_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model_source(smollm2_path), load_tokenizer(smollm2_path)


def make_engine(smollm2_path, smollm2, **overrides) -> LLMEngine:
    config = EngineConfig(model=str(smollm2_path), **{"num_kv_blocks": 256, **overrides})
    return LLMEngine(config, source=smollm2[0])


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Outputs by request, and per step whether each request had its grammar ready."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    seen: list[tuple[set[str], set[str]]] = []  # (requests that got a token, requests still compiling)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        compiling = {r.request_id for r in engine.scheduler.waiting if not r.ready}
        outs = engine.step()
        seen.append(({o.request_id for o in outs if o.new_token_ids}, compiling))
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return [tokens[r] for r in ids], [reasons.get(r) for r in ids], seen


@pytest.mark.slow
def test_plain_requests_run_while_a_grammar_compiles_and_json_outputs_validate(smollm2_path, smollm2):
    engine = make_engine(smollm2_path, smollm2)
    tokenizer = smollm2[1]
    spec = StructuredOutput(json=json.dumps(SCHEMA))
    prompts = [chat(tokenizer, f"Describe pet owner number {i} as JSON.") for i in range(3)]
    params = [SamplingParams(max_tokens=60, temperature=t, seed=i, structured_output=spec)
              for i, t in enumerate((0.0, 1.0, 1.0))]
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs, reasons, seen = run(engine, prompts + [chat(tokenizer, "Say hi.")], params + [plain])
    # The first grammar also loads the tokenizer (seconds): the plain request ran meanwhile.
    assert any("r3" in got and "r0" in compiling for got, compiling in seen)
    for tokens, reason in zip(outputs[:3], reasons[:3]):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"  # the grammar's end ends the request
    assert len(outputs[3]) == 8


@pytest.mark.slow
def test_structured_requests_survive_preemption(smollm2_path, smollm2):
    engine = make_engine(smollm2_path, smollm2, num_kv_blocks=9, max_num_batched_tokens=256)
    tokenizer = smollm2[1]
    regex = StructuredOutput(regex=r"[a-z]{3,8}( [a-z]{3,8}){14,18}\.")
    prompts = [chat(tokenizer, f"Write some words, take {i}.") for i in range(3)]
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_output=regex) for i in range(3)]
    outputs, reasons, _ = run(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    for tokens, reason in zip(outputs, reasons):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert re.fullmatch(regex.regex, text) and reason == "stop", text


@pytest.mark.slow
def test_bad_specs_are_refused_at_the_border(smollm2_path, smollm2):
    engine = make_engine(smollm2_path, smollm2, num_kv_blocks=16)
    for spec in (StructuredOutput(json="{not json"), StructuredOutput(json='{"type": "strange"}'),
                 StructuredOutput(regex="(unclosed"), StructuredOutput(grammar="start: ???"),
                 StructuredOutput(grammar="\u00bcnj\x10\u00b9 KK"),  # not GBNF: its converter raises its own type
                 StructuredOutput(choice=()), StructuredOutput(json="{}", regex="a")):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=spec))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("pattern,ascii", [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"\D\w+\W", "[^0-9][0-9A-Za-z_]+[^0-9A-Za-z_]"),
    (r"[\d.]+|[^\w\s]", "[[:digit:].]+|[^[:word:]\\s]"),
    (r"\\d[\]\d]", "\\\\d[\\][:digit:]]"),  # an escaped backslash, then a class holding `]` and digits
    (r"[]\d][^]\D]", "[][:digit:]][^][:^digit:]]"),  # `]` first in a class is a literal
    (r"[[:alpha:]\d]x\d", "[[:alpha:][:digit:]]x[0-9]"),
])
def test_regex_shorthands_mean_ascii(pattern, ascii):
    assert ascii_shorthands(pattern) == ascii
    assert re.fullmatch(ascii_shorthands(r"\d{3}"), "123")


@pytest.mark.slow
def test_a_regex_digit_is_an_ascii_digit(smollm2_path, smollm2):
    compiler = GrammarCompiler(smollm2_path, smollm2[0][0].vocab_size, eos_token_id=smollm2[1].eos_token_id)
    try:
        template = compiler.submit(StructuredOutput(regex=r"\d{3}-\w")).result(timeout=60)
        for text, ok in (("123-a", True), ("\U0001FBF0\U0001FBF0\U0001FBF0-a", False), ("\u0661\u0662\u0663-a", False),
                         ("123-\u00e9", False)):
            tokens = smollm2[1].encode(text, add_special_tokens=False)
            assert (template.deep_copy().validate_tokens(tokens) == len(tokens)) == ok, text
    finally:
        compiler.shutdown()


def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(tmp_path):
    hf = write_tiny_model(tmp_path, "llama", seed=5)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=32))  # a 70-token prompt takes three chunks
    prompt = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # now its blocks are cached
    engine.add_request("echo", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    got = [lp for o in outs for lp in o.prompt_logprobs]
    assert outs[0].num_cached_tokens == 0 and len(got) == len(prompt) - 1
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i, entry in enumerate(got):  # entry i is prompt token i + 1, predicted at position i
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(expected[i, prompt[i + 1]].item(), abs=1e-4)
        top = expected[i].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
