"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelArgs
from engine.kernels import rotary_embedding_, silu_and_mul
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.fused = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        fused_rope = self.fused and self.q_norm is None
        if fused_rope:
            rotary_embedding_(qkv, positions, self.rope.cos_sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not fused_rope:
            q, k = self.rope(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, rope, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.args = args
        rope = RotaryEmbedding(args.head_dim, max_position, args.rope_theta, args.rope_scaling, dtype)
        # Weights arrive from the checkpoint: skip the random init.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(args, rope, backend) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size)
        self.rope = rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, out_dtype=torch.float32)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Takes transformers' parameter names; fuses q/k/v and gate/up as it goes."""
        params = dict(self.named_parameters())
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            for part, (fused, shard) in stacked.items():
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    self._load_shard(params[target], tensor, fused, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.args.architecture}")
                params[name].data.copy_(tensor)
                loaded.add(name)
        if self.args.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = set(params) - loaded - {"lm_head.weight"}
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, fused: str, shard: int) -> None:
        if fused == "qkv_proj":
            q, kv = self.args.num_heads * self.args.head_dim, self.args.num_kv_heads * self.args.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [self.args.intermediate_size] * 2
        start = sum(sizes[:shard])
        param.data[start:start + sizes[shard]].copy_(tensor)

    def use_cpu_kernels(self) -> None:
        """Switch norms, RoPE and SiLU-and-mul to the native CPU kernels (engine.kernels)."""
        for name, module in self.named_modules():
            # Per-head q/k norms (Qwen3) act on 3-D views and stay in PyTorch.
            if isinstance(module, (RMSNorm, Attention, MLP)) and not name.endswith(("q_norm", "k_norm")):
                module.fused = True

    def prepack_linears(self, packing: str) -> int:
        count = 0
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(packing)
                count += 1
        return count
