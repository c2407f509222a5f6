"""Tiny random Llama-family checkpoints written as Hugging Face folders (config.json + safetensors)."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, **overrides):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 32, **common})
    raise ValueError(family)


def write_tiny_model(path: Path, family: str, seed: int = 0, **overrides):
    """Saves a random model whose logits are sharp enough that greedy choices are not near-ties."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:  # norm scales
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def tiny_llama_source(path: Path) -> tuple[str, object]:
    """A tiny random Llama written to `path` and read once: (its path, the (ModelArgs, tensors) engines take as
    `source`), so a module's engines skip reading it again."""
    from engine.loader import load_model_source

    write_tiny_model(path, "llama")
    return str(path), load_model_source(path)


def tiny_engine(tiny: tuple[str, object], **config):
    """An fp32 LLMEngine over a tiny_llama_source (`config`: EngineConfig fields)."""
    from engine import EngineConfig, LLMEngine

    path, source = tiny
    return LLMEngine(EngineConfig(model=path, dtype="float32", **config), source=source)
