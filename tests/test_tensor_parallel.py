"""Tensor parallelism on CPU: an engine over two local ranks gives what one device gives (tokens, logits, prompt
logprobs), and a rank's death ends the engine at once instead of hanging it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelArgs
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.tp_group import RankFailure
from engine.tp_layout import ShardLayout, check_shardable
from tests.tiny_models import write_tiny_model


def shape(heads: int, kv_heads: int, intermediate: int = 128, vocab: int = 512) -> ModelArgs:
    return ModelArgs(architecture="llama", vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                     num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=1024, tie_word_embeddings=False)


def layouts(args: ModelArgs, world: int) -> list[ShardLayout]:
    return [ShardLayout.of(args, rank, world) for rank in range(world)]


def test_shard_layout_splits_whole_kv_groups_and_copies_kv_heads_when_ranks_outnumber_them():
    even = layouts(shape(8, 4), 2)
    assert [(s.q_heads, s.kv_heads) for s in even] == [((0, 4), (0, 2)), ((4, 8), (2, 4))]
    uneven = layouts(shape(9, 3), 2)  # SmolLM2-135M: 3 KV groups of 3 heads on 2 ranks
    assert [(s.q_heads, s.kv_heads) for s in uneven] == [((0, 3), (0, 1)), ((3, 9), (1, 3))]
    copied = layouts(shape(8, 2), 4)
    assert [(s.q_heads, s.kv_heads) for s in copied] == [((0, 2), (0, 1)), ((2, 4), (0, 1)),
                                                          ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    for parts in (even, uneven, copied):
        assert [s.intermediate for s in parts] == [(a, a + 128 // len(parts)) for a in range(0, 128, 128 // len(parts))]
    vocab = layouts(shape(4, 2, vocab=511), 2)
    assert [s.vocab for s in vocab] == [(0, 256), (256, 511)] and {s.vocab_rows for s in vocab} == {256}


@pytest.mark.parametrize("heads,kv_heads,world,message", [
    (4, 2, 8, "exceeds the model's 4 attention heads"),
    (6, 2, 3, "must be a multiple of 2"),
])
def test_unshardable_models_are_refused_with_what_to_change(heads, kv_heads, world, message):
    with pytest.raises(ValueError, match=message):
        check_shardable(shape(heads, kv_heads), world)


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """fp32 logits at every prompt position, through every rank of the engine."""
    request = Request("logits", prompt, SamplingParams(max_tokens=1), engine.config.block_size)
    assert engine.kv.allocate_slots(request, len(prompt))
    try:
        return engine.runner.all_logits([ScheduledRequest(request, len(prompt))])
    finally:
        engine.kv.free(request)


def prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> list:
    """The prompt's logprobs (chunked prefill: they come a chunk at a time), through every rank."""
    engine.add_request("prompt-logprobs", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    entries = []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        entries += [e for out in engine.step() if out.request_id == "prompt-logprobs" for e in out.prompt_logprobs]
    return entries


def shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 512, (40,), generator=gen).tolist()
    return [prefix + torch.randint(3, 512, (int(k),), generator=gen).tolist()
            for k in torch.randint(5, 60, (n,), generator=gen)]


# A pool too small for the batch (preemption), prompts longer than a step's budget (chunked prefill) that share a
# prefix (prefix-cache hits).
PRESSURE = dict(dtype="float32", block_size=16, num_kv_blocks=20, max_num_batched_tokens=32, max_num_seqs=8,
                enable_prefix_caching=True)

MODELS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "fewer-kv-heads-than-ranks": dict(num_attention_heads=4, num_key_value_heads=1),
    "uneven-kv-groups": dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96),
}


@pytest.mark.parametrize("model,shm", [(m, True) for m in sorted(MODELS)] + [("gqa", False)],
                         ids=[f"{m}-shared-memory" for m in sorted(MODELS)] + ["gqa-gloo"])
def test_two_ranks_give_the_tokens_and_logits_of_one(tmp_path, model, shm):
    write_tiny_model(tmp_path, "llama", seed=3, **MODELS[model])
    prompts = shared_prefix_prompts(6, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), tensor_parallel_size=size, shm_collectives=shm,
                                        **PRESSURE))
        try:
            logits = prompt_logits(engine, prompts[0])
            tokens = engine.generate(prompts, params)
            stats = engine.stats()
            entries = prompt_logprobs(engine, prompts[1])
        finally:
            engine.close()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
        results[size] = (logits, tokens, entries)
    torch.testing.assert_close(results[2][0], results[1][0], atol=1e-4, rtol=1e-4)
    assert results[2][1] == results[1][1]
    one, two = results[1][2], results[2][2]
    assert len(one) == len(two) == len(prompts[1]) - 1
    assert [e.token_id for e in two] == [e.token_id for e in one]

    def values(entries):  # each prompt token's logprob, then its top-2 (ids may swap on a near-tie)
        return torch.tensor([[e.logprob] + [lp for _, lp in e.top] for e in entries])

    torch.testing.assert_close(values(two), values(one), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shm", [pytest.param(True, id="shared-memory"), pytest.param(False, id="gloo")])
def test_a_rank_that_dies_ends_the_engine_at_once(tmp_path, shm):
    write_tiny_model(tmp_path, "llama", seed=3)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), tensor_parallel_size=2, dtype="float32", num_kv_blocks=32,
                                    shm_collectives=shm))
    try:
        engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        engine.step()
        assert engine.rank_failure() is None
        os.kill(engine.ranks.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - start < 5, "the dead rank was found by a timeout, not at once"
        assert isinstance(engine.rank_failure(), RankFailure)
    finally:
        engine.close()


def test_an_idle_engine_notices_a_dead_rank(tmp_path):
    write_tiny_model(tmp_path, "llama", seed=3)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), tensor_parallel_size=2, dtype="float32", num_kv_blocks=32))
    try:
        os.kill(engine.ranks.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.rank_failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 1" in str(engine.rank_failure())
    finally:
        engine.close()


def test_a_rank_that_hangs_fails_the_step_within_the_collective_timeout(tmp_path):
    write_tiny_model(tmp_path, "llama", seed=3)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), tensor_parallel_size=2, dtype="float32", num_kv_blocks=32,
                                    collective_timeout_s=2.0))
    pid = engine.ranks.processes[0].pid
    try:
        engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        # The step's broadcast (gloo) or the first all-reduce (shared memory), whichever waits on the rank first.
        with pytest.raises(RankFailure, match=r"2000ms|within 2"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - start < 6
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_the_app_refuses_a_tensor_parallel_size_the_model_cannot_split_before_any_replica_starts(tmp_path):
    from deployments.app import build_app
    from deployments.config import AppArgs

    write_tiny_model(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        build_app(AppArgs(model=str(tmp_path), engine_num_cpus=1, engine={"tensor_parallel_size": 8}))
