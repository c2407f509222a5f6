"""Model sources: a Hugging Face folder (config.json, safetensors, tokenizer) or a GGUF file.

Only local paths: nothing here reaches a hub.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelArgs
from engine.gguf_file import GGUFFile, GGUFTensor

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEQUANTIZED_VERSION = 2  # bump when the conversion below changes: older dequantized copies are then ignored

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


MODEL_HINT = ("run `make model` to fetch the default model (SmolLM2-135M-Instruct), or set `model` to a GGUF file or "
              "a Hugging Face folder")
GGUF_MAGIC = b"GGUF"


def check_model_source(path: str | Path) -> Path:
    """The path, expanded, if it looks like a model this loader can read: an error naming it and the fix if not.

    Cheap (a stat and a few bytes), so callers run it before starting anything that would fail on it later.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist: {MODEL_HINT}")
    if not path.is_dir() and not is_gguf(path):
        raise ValueError(f"model path {path} is neither a .gguf file nor a Hugging Face folder: {MODEL_HINT}")
    first = path if is_gguf(path) else path / "config.json"
    if not first.exists():
        raise FileNotFoundError(f"model folder {path} has no config.json (a Hugging Face folder holds config.json "
                                f"and *.safetensors): {MODEL_HINT}")
    try:
        with open(first, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise PermissionError(f"cannot read model {first} ({exc.strerror}): {MODEL_HINT}") from None
    if is_gguf(path) and head != GGUF_MAGIC:
        raise ValueError(f"model file {path} is not a GGUF file (an interrupted download?): {MODEL_HINT}")
    if not is_gguf(path) and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no .safetensors files in the model folder {path}")
    return path


class CheckpointTensor:
    """One checkpoint tensor, read whole or as a slice along one dimension, only when asked: a tensor-parallel
    rank reads its own rows or columns and never holds the whole model."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[int, int, int], torch.Tensor]) -> None:
        self.shape = tuple(int(d) for d in shape)
        self._read = read

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "CheckpointTensor":
        return cls(tuple(tensor.shape), lambda dim, start, end: tensor.narrow(dim, start, end - start))

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The tensor, or its [start, end) slice along `dim`."""
        end = self.shape[dim] if end is None else end
        return self._read(dim, start, end)


def as_checkpoint(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, CheckpointTensor]]
                  ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Loaded tensors (a dict) or a lazy checkpoint, as (name, CheckpointTensor) pairs."""
    if isinstance(weights, Mapping):
        return ((name, CheckpointTensor.of(t)) for name, t in weights.items())
    return iter(weights)


def read_model_args(path: str | Path, gguf_reader: GGUFFile | None = None) -> ModelArgs:
    """`gguf_reader`: `path`'s GGUF header, already read."""
    path = check_model_source(path)
    if is_gguf(path):
        cached = _dequantized_path(path)
        if cached.exists():
            return _dequantized_args(cached)
        return _gguf_args(gguf_reader or GGUFFile(path))
    from transformers import AutoConfig
    return ModelArgs.from_hf_config(AutoConfig.from_pretrained(path, local_files_only=True))


def iter_checkpoint(path: str | Path, args: ModelArgs, gguf_reader: GGUFFile | None = None
                    ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, named as transformers names them, read lazily (CheckpointTensor)."""
    path = check_model_source(path)
    if is_gguf(path):
        cached = _dequantized_path(path)
        yield from _safetensors_file(cached) if cached.exists() else _gguf_tensors(path, args, gguf_reader)
        return
    for f in sorted(path.glob("*.safetensors")):
        yield from _safetensors_file(f)


def _safetensors_file(f: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    from safetensors import safe_open

    with safe_open(f, framework="pt") as handle:
        for name in handle.keys():
            yield name, _safetensors_tensor(handle.get_slice(name))


def _safetensors_tensor(part: Any) -> CheckpointTensor:
    def read(dim: int, start: int, end: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, end),)
        return part[index]

    return CheckpointTensor(tuple(part.get_shape()), read)


def open_checkpoint(path: str | Path) -> tuple[ModelArgs, Iterator[tuple[str, CheckpointTensor]]]:
    """ModelArgs and the checkpoint's tensors, lazily; logs the load's start and, once iterated, its end."""
    path = check_model_source(path)
    size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.safetensors")))
    log.info("loading the model from %s (%.0f MB)", path, size / 2**20)
    # A GGUF file without its dequantized copy: its header read once, for the arguments and the tensors.
    reader = GGUFFile(path) if is_gguf(path) and not _dequantized_path(path).exists() else None
    args = read_model_args(path, reader)

    def logged() -> Iterator[tuple[str, CheckpointTensor]]:
        start, count = time.perf_counter(), 0
        for item in iter_checkpoint(path, args, reader):
            count += 1
            yield item
        log.info("loaded %d tensors of a %d-layer %s in %.1f s", count, args.num_layers, args.architecture,
                 time.perf_counter() - start)

    return args, logged()


def load_model_source(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and fp32/bf16 tensors named as transformers names them, all read."""
    args, tensors = open_checkpoint(path)
    return args, {name: tensor.read() for name, tensor in tensors}


def _gguf_args(reader: GGUFFile) -> ModelArgs:
    arch = reader.fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported")
    f = lambda key, default=None: reader.fields.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, num_heads = f("embedding_length"), f("attention.head_count")
    num_kv_heads = f("attention.head_count_kv", num_heads)
    tensors = {t.name: t for t in reader.tensors}
    vocab = f("vocab_size") or int(tensors["token_embd.weight"].shape[-1])
    head_dim = f("attention.key_length") or hidden // num_heads
    rope_scaling = None
    if reader.fields.get(f"{arch}.rope.scaling.type") in ("linear", "yarn"):
        rope_scaling = {"rope_type": f("rope.scaling.type"), "factor": f("rope.scaling.factor"),
                        "original_max_position_embeddings": f("rope.scaling.original_context_length")}
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    return ModelArgs(
        architecture="llama" if arch == "mistral" else arch, vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(f("feed_forward_length")), num_layers=int(f("block_count")),
        num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")), rope_theta=float(f("rope.freq_base", 10000.0)),
        max_position_embeddings=int(f("context_length")), tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=rope_scaling, bos_token_id=reader.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _gguf_tensors(path: Path, args: ModelArgs, reader: GGUFFile | None = None
                  ) -> Iterator[tuple[str, CheckpointTensor]]:
    """The GGUF file's tensors, dequantized when read; once every one was read whole (one device), they are kept
    dequantized for the next start (a rank that reads slices keeps nothing: it never holds the whole model)."""
    reader = reader or GGUFFile(path)
    arch = reader.fields.get("general.architecture")
    whole: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        heads = None
        if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            # llama.cpp interleaves q/k rows for its RoPE; undone per head, so a slice of whole heads undoes alone.
            heads = args.num_heads if ".attn_q." in tensor.name else args.num_kv_heads
        yield _hf_name(tensor.name), _gguf_tensor(tensor, heads, _hf_name(tensor.name), whole)
    if len(whole) == len(reader.tensors):
        _save_dequantized(args, whole, _dequantized_path(path))


def _gguf_tensor(tensor: GGUFTensor, heads: int | None, name: str, whole: dict[str, torch.Tensor]) -> CheckpointTensor:
    from gguf import dequantize

    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dimensions innermost first

    def read(dim: int, start: int, end: int) -> torch.Tensor:
        # Quantised blocks run along a row: rows (dim 0) are dequantised alone, columns after the whole rows.
        rows = (start, end) if dim == 0 else (0, shape[0])
        array = dequantize(tensor.data[rows[0]:rows[1]], tensor.tensor_type)
        if heads is not None:
            array = _unpermute_qk(array, heads * (rows[1] - rows[0]) // shape[0])
        out = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        if (start, end) == (0, shape[dim]):
            whole[name] = out
        return out if dim == 0 else out.narrow(dim, start, end - start)

    return CheckpointTensor(shape, read)


def _dequantized_path(path: Path) -> Path:
    """Where the dequantized tensors of this GGUF file (this size, this modification time) are kept: a replica
    that starts later reads them instead of dequantizing again (~3 s of CPU here, far more on a busy machine)."""
    return _cached_path(path, "dequantized", ".safetensors", str(DEQUANTIZED_VERSION))


def _cached_path(path: Path, kind: str, suffix: str, version: str | None = None) -> Path:
    """Where what is derived from this GGUF file (this path, size and modification time; `version`: of the code
    that derives it, by default the transformers that does) is kept in the cache."""
    from engine.model_fetch import cache_dir

    if version is None:
        import transformers
        version = f"transformers-{transformers.__version__}"
    stat = path.stat()
    key = hashlib.sha256(f"{version}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_dir() / kind / f"{path.stem}-{key.hexdigest()[:16]}{suffix}"


def _dequantized_args(cached: Path) -> ModelArgs:
    from safetensors import safe_open

    with safe_open(cached, framework="pt") as f:
        fields = json.loads(f.metadata()["model_args"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    return ModelArgs(**fields)


def _save_dequantized(args: ModelArgs, weights: dict[str, torch.Tensor], target: Path) -> None:
    """Best effort: a full disk or a read-only cache only costs the next start its dequantizing."""
    from safetensors.torch import save_file

    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, partial, metadata={"model_args": json.dumps(dataclasses.asdict(args))})
        partial.replace(target)  # atomic: a replica reading at the same time sees the whole file or none
    except OSError as exc:
        log.warning("could not keep the dequantized weights at %s: %s", target, exc)
        partial.unlink(missing_ok=True)


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def load_tokenizer(path: str | Path) -> Any:
    """The model's tokenizer with its chat template: from the HF folder, or rebuilt from GGUF metadata. Rebuilding
    parses the whole GGUF file in Python (8-9 s here, most of an ingress replica's start), so the rebuilt tokenizer
    is kept in the cache beside the dequantized weights, keyed like them and on the transformers version that
    built it, and the next process reads that (0.5 s)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    kept = _cached_path(path, "tokenizers", "")
    if (kept / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(kept, local_files_only=True)
        except Exception as exc:  # a damaged copy (the tokenizers library raises plain Exceptions): rebuilt over
            log.warning("could not read the kept tokenizer %s (%s); rebuilding it from %s", kept, exc, path)
            shutil.rmtree(kept, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    _keep_tokenizer(tokenizer, kept)
    return tokenizer


def _keep_tokenizer(tokenizer: Any, target: Path) -> None:
    """Best effort, like the dequantized weights: written beside the target, then renamed into place, so a process
    reading at the same time sees the whole folder or none; the first of several writers wins."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    except OSError as exc:
        if not target.exists():
            log.warning("could not keep the tokenizer at %s: %s", target, exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def read_generation_eos(path: str | Path) -> tuple[int, ...]:
    """Extra stop ids from generation_config.json (chat models often end turns with another token)."""
    gen = Path(path).expanduser() / "generation_config.json"
    if is_gguf(path) or not gen.exists():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
