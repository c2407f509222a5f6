"""`make gpu-check` runs on a GPU machine with no Ray and no gguf; its benchmark code runs here on CPU too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_check import SHAPES, RandomWeights, bench_shape
from engine.config import ModelArgs

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_imports_neither_ray_nor_gguf():
    code = ("import sys, benchmarks.gpu_check, engine.triton_attention, engine.cuda_graphs, engine.gpu_memory; "
            "bad = {'ray', 'gguf'} & set(sys.modules); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_random_checkpoints_have_every_tensor_the_model_loads():
    for args in SHAPES.values():
        names = dict(RandomWeights(args, None, None, 0, 0.02).shapes())
        assert names["model.embed_tokens.weight"] == (args.vocab_size, args.hidden_size)
        assert ("lm_head.weight" in names) != args.tie_word_embeddings
        assert len(names) == 9 * args.num_layers + 2 + (not args.tie_word_embeddings)


def test_the_benchmark_times_decodes_and_prefill_of_a_random_model_on_cpu():
    tiny = ModelArgs("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=1024, tie_word_embeddings=True)
    rows, prefill, info = bench_shape("tiny", tiny, "cpu", [1, 3], prompt_len=8, steps=4, dtype="float32",
                                      max_model_len=1024, num_kv_blocks=64, prefill=(4, 40))
    assert [(r.batch, r.cuda_graphs) for r in rows] == [(1, False), (3, False)] and not info["cuda_graphs"]
    assert all(r.ms_per_step > 0 and r.tok_s > 0 for r in rows) and prefill > 0
