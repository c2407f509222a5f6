"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

With tensor parallelism each rank builds the layers of its ShardLayout (engine/tp_layout.py): its heads, its share
of the MLP and of the vocabulary, and all-reduces after o_proj, down_proj and the embedding; `group` is None on one
device.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelArgs
from engine.kernels import native_int8_max_rows, rotary_embedding_
from engine.loader import CheckpointTensor, as_checkpoint
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from engine.tp_group import TensorParallelGroup
from engine.tp_layout import ShardLayout

# "0" keeps the decoder layers in Python even where one native call could run them (to compare the two).
NATIVE_LAYERS_ENV = "TOKENLINE_NATIVE_LAYERS"


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layout: ShardLayout, rope: RotaryEmbedding, backend: AttentionBackend,
                 group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.group = group
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
        out = self.o_proj(self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta))
        return out if self.group is None else self.group.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layout: ShardLayout, group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * self.intermediate_size)
        self.down_proj = Linear(self.intermediate_size, args.hidden_size)
        self.group = group
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            out = self.down_proj(self.gate_up_proj.silu_mul(x))
        else:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.group is None else self.group.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layout: ShardLayout, rope: RotaryEmbedding, backend: AttentionBackend,
                 group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layout, rope, backend, group)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, layout, group)

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, o, gate_up, down: in the order llama_layers reads them."""
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, dtype: torch.dtype, max_position: int,
                 layout: ShardLayout | None = None, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.args = args
        self.layout = layout = layout or ShardLayout.full(args)
        self.group = group
        rope = RotaryEmbedding(args.head_dim, max_position, args.rope_theta, args.rope_scaling, dtype)
        # Weights arrive from the checkpoint: skip the random init. Vocabulary rows past the model's are zeros.
        rows = layout.vocab_rows
        self.embed_tokens = nn.Embedding(rows, args.hidden_size, _weight=torch.zeros(rows, args.hidden_size),
                                         _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(args, layout, rope, backend, group) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, rows)
        self.rope = rope
        self.native_layers = False  # use_native_layers(): the layers in one call of engine/kernels/llama_cpu.cpp
        self.native_max_rows: int | None = None  # use_onednn_above(): larger steps run the modules, on oneDNN's linears
        self._native_params: list[torch.Tensor | None] = []
        self._native_caches: tuple[list, list[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        if self.native_layers and meta.token_block_tables is not None and (
                self.native_max_rows is None or x.shape[0] <= self.native_max_rows):
            return self._native_forward(x, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.norm(x, residual)[0]

    def _native_forward(self, x: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm in one native call: the same kernels on the same tensors as the modules."""
        if self._native_caches is None or self._native_caches[0] is not kv_caches:
            self._native_caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        _, k_caches, v_caches = self._native_caches
        attn = self.layers[0].self_attn
        return torch.ops.tokenline.llama_layers(
            x, positions, meta.slot_mapping, meta.token_block_tables, meta.token_positions + 1, self.rope.cos_sin,
            self._native_params, k_caches, v_caches, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.layers[0].mlp.intermediate_size, self.norm.eps, attn.backend.scale, native_int8_max_rows(),
            attn.backend.query_tiles)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the ids it holds, zeros for the others; the sum is the lookup.
        start, end = self.layout.vocab
        held = (input_ids >= start) & (input_ids < end)
        x = self.embed_tokens(torch.where(held, input_ids - start, 0))
        return self.group.all_reduce(x.masked_fill_(~held.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits over the whole vocabulary; with tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.lm_head(hidden, out_dtype=torch.float32)
        if self.group is None:
            return logits
        parts = self.group.gather(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.args.vocab_size]

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Takes transformers' parameter names; fuses q/k/v and gate/up, and reads only this rank's part of
        each tensor."""
        params = dict(self.named_parameters())
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in as_checkpoint(weights):
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            for part, (fused, shard) in stacked.items():
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    self._load_stacked(params[target], tensor, fused, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.args.architecture}")
                self._load_split(params[name], name, tensor)
                loaded.add(name)
        if self.args.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = set(params) - loaded - {"lm_head.weight"}
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")

    def _load_stacked(self, param: nn.Parameter, tensor: CheckpointTensor, fused: str, shard: int) -> None:
        """This rank's rows of q, k, v (its heads) or gate, up (its features), at their place in the fused one."""
        layout, head_dim = self.layout, self.args.head_dim
        if fused == "qkv_proj":
            ranges = [layout.q_heads, layout.kv_heads, layout.kv_heads]
            ranges = [(a * head_dim, b * head_dim) for a, b in ranges]
        else:
            ranges = [layout.intermediate] * 2
        start, end = ranges[shard]
        offset = sum(b - a for a, b in ranges[:shard])
        param.data[offset:offset + end - start].copy_(tensor.read(0, start, end))

    def _load_split(self, param: nn.Parameter, name: str, tensor: CheckpointTensor) -> None:
        """Row-parallel inputs (o_proj, down_proj) by column, the vocabulary by row, the rest whole."""
        head_dim = self.args.head_dim
        if name.endswith("o_proj.weight"):
            start, end = self.layout.q_heads
            param.data.copy_(tensor.read(1, start * head_dim, end * head_dim))
        elif name.endswith("down_proj.weight"):
            param.data.copy_(tensor.read(1, *self.layout.intermediate))
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            start, end = self.layout.vocab
            param.data[:end - start].copy_(tensor.read(0, start, end))
        else:
            param.data.copy_(tensor.read())

    def use_cpu_kernels(self) -> None:
        """Switch norms, RoPE and SiLU-and-mul to the native CPU kernels (engine.kernels)."""
        for name, module in self.named_modules():
            # Per-head q/k norms (Qwen3) act on 3-D views and stay in PyTorch.
            if isinstance(module, (RMSNorm, Attention, MLP)) and not name.endswith(("q_norm", "k_norm")):
                module.fused = True

    def use_native_layers(self) -> bool:
        """Run the decoder layers in one native call (engine/kernels/llama_cpu.cpp) on steps whose every new token is
        a row of the paged attention kernel, where every part of a layer already runs on a native CPU kernel: the
        norms, RoPE and SiLU fused (use_cpu_kernels), the linears packed natively (prepack_linears), keys packed
        (CpuAttention), no per-head q/k norm, one device. Call after both; True where it applies."""
        from engine.kernels import native_layers_available

        layers = list(self.layers)
        linears = [lin for layer in layers for lin in layer.linears()]
        self.native_layers = bool(
            layers and self.group is None and os.environ.get(NATIVE_LAYERS_ENV, "1") != "0"
            and getattr(layers[0].self_attn.backend, "uses_token_rows", False) and self.norm.fused
            and all(layer.self_attn.fused and layer.self_attn.q_norm is None and layer.mlp.fused
                    and layer.input_layernorm.fused and layer.post_attention_layernorm.fused for layer in layers)
            and all(lin.packing in ("native", "native-int8") for lin in linears)
            and native_layers_available())
        self._native_params = self.native_layer_params() if self.native_layers else []
        return self.native_layers

    def native_layer_params(self) -> list[torch.Tensor | None]:
        """Each layer's parameters in the order llama_layers reads them (its two norms' weights, then for qkv, o,
        gate_up and down: the packed weight, bias, int8 weight, int8 scales), then the final norm's weight."""
        params: list[torch.Tensor | None] = []
        for layer in self.layers:
            params += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for lin in layer.linears():
                params += [lin.packed, lin.bias, lin.packed_int8, lin.scales]
        return params + [self.norm.weight]

    def use_onednn_above(self, rows: int) -> None:
        """Steps of more than `rows` tokens run the layers module by module, every linear on oneDNN's prepacked
        kernel (a second copy of each weight, in its layout); smaller ones stay on the native kernels."""
        self.native_max_rows = rows
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_onednn_above(rows)

    def drop_plain_weights(self) -> int:
        """Lets go of every packed linear's plain weight (Linear.drop_plain_weight), but for one that another module
        reads too (the LM head tied to the embeddings). Returns the bytes let go."""
        shared = {id(p) for m in self.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
        return sum(m.drop_plain_weight() for m in self.modules()
                   if isinstance(m, Linear) and id(m.weight) not in shared)

    def prepack_linears(self, packing: str) -> int:
        count = 0
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(packing)
                count += 1
        return count
