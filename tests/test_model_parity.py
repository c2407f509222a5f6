"""Our model against transformers with the same weights: logits and greedy continuations, in fp32."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import cpu_kernels_available
from tests.tiny_models import FAMILIES, write_tiny_model

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def engine_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the engine's real paged-attention forward."""
    from engine.request import Request
    from engine.scheduler import ScheduledRequest

    request = Request("parity", prompt, SamplingParams(max_tokens=1), engine.config.block_size)
    assert engine.kv.allocate_slots(request, len(prompt))
    try:
        input_ids, positions, meta, _ = engine.runner._prepare([ScheduledRequest(request, len(prompt))])
        with torch.inference_mode():
            hidden = engine.runner.model(input_ids, positions, engine.runner.kv_caches, meta)
            return engine.runner.model.compute_logits(hidden)
    finally:
        engine.kv.free(request)


def _rope_kwargs(variant: str | None) -> dict:
    if variant is None:
        return {}
    return {"rope_parameters": {"rope_theta": 10000.0, **ROPE_VARIANTS[variant]}}


BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_kernels_available(), reason="no C++ toolchain here to build the native CPU kernels"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    hf = write_tiny_model(tmp_path, family)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64))
    prompt = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(prompt.unsqueeze(0)).logits[0]
    torch.testing.assert_close(engine_logits(engine, prompt.tolist()), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_scaled_rope_matches_transformers(tmp_path, variant):
    hf = write_tiny_model(tmp_path, "llama", **_rope_kwargs(variant))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64))
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(prompt.unsqueeze(0)).logits[0]
    torch.testing.assert_close(engine_logits(engine, prompt.tolist()), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuations_match_generate(tmp_path, family, backend):
    hf = write_tiny_model(tmp_path, family, seed=3)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=128,
                                    attention_backend=backend))
    assert engine.runner.attention_backend == backend
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 33, 64, 90, 120, 7, 48)]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path):
    """Our engine and transformers' own GGUF loader on the same file: two independent readings of it."""
    from transformers import AutoModelForCausalLM

    from engine.loader import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                              dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(smollm2_path), dtype="float32", num_kv_blocks=512))
    return engine, hf, load_tokenizer(smollm2_path)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_pair):
    engine, hf, tokenizer = smollm2_pair
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(engine_logits(engine, prompt), expected, atol=2e-4, rtol=1e-4)


SMOLLM2_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "List three prime numbers.", "How do airplanes fly?", "Translate 'good morning' into Spanish.",
    "What is 12 times 7?", "Give me a tip for learning to code.",
]


@pytest.mark.slow
def test_smollm2_greedy_matches_generate(smollm2_pair):
    engine, hf, tokenizer = smollm2_pair
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for p in SMOLLM2_PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()
    assert "Paris" in tokenizer.decode(ours[0])
