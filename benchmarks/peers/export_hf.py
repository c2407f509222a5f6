"""Writes a Hugging Face folder (config.json, bf16 safetensors, tokenizer) of a model tokenline loads, so a peer
server that reads only Hugging Face folders serves the very same weights.

    python -m benchmarks.peers.export_hf ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from engine.config import ModelArgs
from engine.loader import load_model_source, load_tokenizer

log = logging.getLogger(__name__)


def hf_llama_config(args: ModelArgs):
    """transformers' LlamaConfig for a Llama-shaped ModelArgs (default or scaled RoPE)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                       intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                       num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                       head_dim=args.head_dim, rms_norm_eps=args.rms_norm_eps,
                       max_position_embeddings=args.max_position_embeddings,
                       tie_word_embeddings=args.tie_word_embeddings, attention_bias=args.attention_bias,
                       bos_token_id=args.bos_token_id,
                       eos_token_id=list(args.eos_token_ids) if args.eos_token_ids else None,
                       rope_parameters=rope)


def export(model: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    args, weights = load_model_source(model)
    if args.architecture != "llama" or args.qk_norm:
        raise ValueError(f"only Llama-shaped models are exported; {model} is {args.architecture}")
    out.mkdir(parents=True, exist_ok=True)
    hf_llama_config(args).save_pretrained(out)
    tensors = {name: t.to(dtype).contiguous() for name, t in weights.items()
               if not (args.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(model).save_pretrained(out)
    log.info("wrote %s (%d tensors, %s)", out, len(tensors), dtype)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(export(args.model, args.out))


if __name__ == "__main__":
    main()
