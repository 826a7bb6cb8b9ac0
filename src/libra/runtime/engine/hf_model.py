"""Llama-family checkpoints (Llama, SmolLM, Mistral, Qwen2, Qwen3) on the engine's paged KV cache.

Why a model of our own rather than `transformers`' classes: the engine runs one forward pass per
continuous-batching step over a ragged, flattened batch (decodes and prefill chunks together)
that reads and writes a paged KV cache; `transformers`' modules assume a padded batch and their
own cache. So this is the same decoder written the way the built-in model is (`model.Block`),
with the checkpoint's own names (`model.layers.N.self_attn.q_proj.weight`, ...), so that:

- a Hugging Face `state_dict` loads as is, and what the trainer saves is one too;
- the engine and the trainer call it exactly as they call `TinyTransformer`: `forward(StepBatch,
  KVCache)` for a step, `forward_train(tokens)` for the cache-free differentiable pass;
- peft's LoRA finds its target modules by their usual names (`q_proj`, `v_proj`, ...).

What differs between the family's members is read from the config, never assumed: grouped-query
attention (`num_key_value_heads`), `head_dim`, biases on q/k/v (Qwen2) or on every projection
(`attention_bias`), per-head RMSNorm of q and k (Qwen3), tied embeddings, the norm epsilon and
the rotary embedding (any `rope_type` transformers knows, through its own init function, so the
frequencies are transformers' to the bit). `tests/test_hf_model.py` checks the log-probabilities
against a `transformers` forward of the same weights to 1e-4 in float32.

Loading needs the `hf` extra (transformers, safetensors, and gguf for GGUF files); the module
itself only needs torch, so a test can build one from a config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libra.core.errors import ConfigError
from libra.runtime.engine.kv_cache import KVCache
from libra.runtime.engine.model import StepBatch, apply_rope, attention
from libra.runtime.engine.presets import ModelPreset
from libra.runtime.engine.sources import HF_EXTRA, ModelSource, converted, gguf_cache, hf_spec


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, operation for operation (float32 statistics, then the weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict, spec: ModelPreset):
        super().__init__()
        d, h, kv, hd = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
        qkv_bias = bool(cfg.get("attention_bias", spec.arch == "qwen2"))
        self.q_proj = nn.Linear(d, h * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=bool(cfg.get("attention_bias", False)))
        if spec.arch == "qwen3":  # per-head norms of q and k, before the rotary embedding
            self.q_norm, self.k_norm = RMSNorm(hd, _eps(cfg)), RMSNorm(hd, _eps(cfg))
        self.h, self.kv, self.hd = h, kv, hd

    def qkv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., H, D], k and v [..., KVH, D] for x [..., d_model], rotated."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.h, self.hd)
        k = self.k_proj(x).view(*lead, self.kv, self.hd)
        v = self.v_proj(x).view(*lead, self.kv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, *rope), apply_rope(k, *rope), v


class MLP(nn.Module):
    def __init__(self, cfg: dict, spec: ModelPreset):
        super().__init__()
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_proj = nn.Linear(spec.d_model, spec.d_ff, bias=bias)
        self.up_proj = nn.Linear(spec.d_model, spec.d_ff, bias=bias)
        self.down_proj = nn.Linear(spec.d_ff, spec.d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, spec: ModelPreset):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg, spec), MLP(cfg, spec)
        self.input_layernorm = RMSNorm(spec.d_model, _eps(cfg))
        self.post_attention_layernorm = RMSNorm(spec.d_model, _eps(cfg))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], b: StepBatch, kc: Tensor, vc: Tensor) -> Tensor:
        t, a = x.shape[0], self.self_attn
        q, k, v = a.qkv(self.input_layernorm(x), rope)
        kc.index_copy_(0, b.slots, k.to(kc.dtype))
        vc.index_copy_(0, b.slots, v.to(vc.dtype))
        x = x + a.o_proj(attention(q, k, v, b, kc, vc).reshape(t, a.h * a.hd))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_train(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        (b, t), a = x.shape[:2], self.self_attn
        q, k, v = a.qkv(self.input_layernorm(x), rope)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=a.kv != a.h
        )
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, a.h * a.hd))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: dict, spec: ModelPreset):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, _eps(cfg))


class LlamaFamily(nn.Module):
    """A Llama-family causal LM with the engine's interface (see the module docstring)."""

    def __init__(self, cfg: dict, spec: ModelPreset):
        super().__init__()
        self.hf_config, self.preset = cfg, spec
        self.model = Backbone(cfg, spec)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :].to(positions.device)
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def forward(self, b: StepBatch, cache: KVCache) -> Tensor:
        """Logits [S, vocab] for `b.sample_rows`, after writing every token's keys and values."""
        x = self.model.embed_tokens(b.tokens)
        rope = self.rope(b.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, b, cache.k[i], cache.v[i])
        x = x if b.sample_rows is None else x[b.sample_rows]
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def apply_adapter(self, tensors: dict[str, Tensor]) -> int:
        """A LoRA adapter (`train/lora.py`: `<module>.lora_A.weight`, `.lora_B.weight`, `lora.scale`):
        each adapted weight becomes its base weight plus scale * B @ A. The base weights are kept
        from the first adapter on, so a new adapter replaces the previous one instead of adding
        to it. Returns the number of weights updated."""
        scale = float(tensors["lora.scale"])
        if not hasattr(self, "_base"):
            self._base: dict[str, Tensor] = {}
        modules, n = dict(self.named_modules()), 0
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removesuffix(".lora_A.weight")
            w = modules[name].weight
            base = self._base.setdefault(name, w.detach().clone())
            b = tensors[f"{name}.lora_B.weight"]
            w.copy_(base + scale * (b.float() @ a.float()).to(base))
            n += 1
        return n

    def check_adapter(self, tensors: dict, where: str, field: str) -> None:
        """An adapter's names and shapes against this model's linear layers."""
        modules = dict(self.named_modules())
        for key in tensors:
            if key == "lora.scale":
                continue
            name, _, kind = key.rpartition(".lora_")
            m = modules.get(name)
            ok = isinstance(m, nn.Linear) and kind in ("A.weight", "B.weight") and f"{name}.lora_A.weight" in tensors and f"{name}.lora_B.weight" in tensors  # fmt: skip
            if ok:
                a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
                ok = a.shape[1] == m.in_features and b.shape[0] == m.out_features and a.shape[0] == b.shape[1]
            if not ok:
                raise ConfigError(
                    field, where, f"a LoRA adapter of this model's linear layers ({key!r} does not fit)"
                )

    def forward_train(self, tokens: Tensor, rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Logits [B, T, vocab] of right-padded `tokens` [B, T], cache-free and differentiable;
        given `rows` (a `nonzero(as_tuple=True)` of [B, T]), only those positions' [N, vocab]."""
        x = self.model.embed_tokens(tokens)
        rope = self.rope(torch.arange(tokens.shape[1], device=tokens.device), x.dtype)
        for layer in self.model.layers:
            x = layer.forward_train(x, rope)
        return self.lm_head(self.model.norm(x if rows is None else x[rows]))


def _eps(cfg: dict) -> float:
    return float(cfg.get("rms_norm_eps", 1e-6))


def rope_frequencies(cfg: dict) -> tuple[Tensor, float]:
    """(inv_freq, attention scaling) by transformers' own init function for the config's rope type
    (default, llama3, yarn, ...), so the angles match a transformers forward exactly."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**cfg)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind == "default":  # computed here: transformers 5 keeps the default outside the table
        base = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        dim = int(dim * float(cfg.get("partial_rotary_factor", 1.0)))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(scale)


# ---- loading -------------------------------------------------------------------------------------


def _need_hf(what: str):
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as e:
        raise ConfigError("model", what, f"the 'hf' extra installed (missing module {e.name!r}): {HF_EXTRA}") from None  # fmt: skip


def build_hf_model(src: ModelSource, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaFamily:  # fmt: skip
    """The model of a Hugging Face directory or GGUF file, weights loaded, on `device`."""
    _need_hf(src.name)
    cfg, state = load_gguf(src.path) if src.kind == "gguf" else load_hf_dir(src.path, src.name)
    spec = src.spec
    model = LlamaFamily(cfg, hf_spec(cfg, src.name).with_context(spec.max_model_len))
    load_weights(model, state, src.name)
    return model.to(device=device, dtype=dtype)


def load_weights(model: LlamaFamily, state: dict[str, Tensor], where: str, field: str = "model") -> None:
    """A Hugging Face state_dict into `model`, checked: names and shapes (a tied head may be absent)."""
    own = model.state_dict()
    if model.tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        own = {k: v for k, v in own.items() if k != "lm_head.weight"}
    check_state(own, state, where, field)
    model.load_state_dict(state, strict=False)


def check_state(own: dict[str, Tensor], state: dict, where: str, field: str) -> None:
    missing = sorted(own.keys() - state.keys())
    extra = sorted(k for k in state.keys() - own.keys() if not k.endswith("rotary_emb.inv_freq"))
    bad = sorted(k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or extra or bad:
        detail = f"missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {bad[:3]}"
        raise ConfigError(field, where, f"the weights of this model's architecture ({detail})")


def load_hf_dir(path: Path, name: str) -> tuple[dict, dict[str, Tensor]]:
    """config.json and every *.safetensors shard of a local checkpoint (nothing is downloaded)."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ConfigError("model", name, "a directory with *.safetensors weights (none found)")
    state: dict[str, Tensor] = {}
    for f in shards:
        state.update(load_file(str(f)))
    return cfg, state


def load_gguf(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """A GGUF file's config and weights, dequantized to float32 by transformers' GGUF reader, and
    kept as a Hugging Face directory (`sources.gguf_cache`) so the next load is a safetensors read."""
    done = converted(path)
    if done is not None:
        return load_hf_dir(done, str(path))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ImportError, ModuleNotFoundError) as e:
        raise ConfigError("model", str(path), f"the 'hf' extra installed to read GGUF ({e}): {HF_EXTRA}") from None  # fmt: skip
    _keep(hf, tok, gguf_cache(path))
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    return cfg, {k: v for k, v in hf.state_dict().items()}


def _keep(hf, tok, out: Path) -> None:
    """Write the conversion to a temporary folder and rename it: concurrent loads never see half."""
    import os
    import shutil

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    from safetensors.torch import save_file

    try:
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights written are float32
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # the same tensor as the embedding
        save_file(state, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        (tmp / "done").write_text("")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    except OSError:  # a read-only or full disk: the next load converts again
        shutil.rmtree(tmp, ignore_errors=True)


def random_hf_model(cfg: dict, seed: int, name: str = "random") -> LlamaFamily:
    """A model of `cfg`'s shape with seeded random weights (benchmarks and the device script)."""
    torch.manual_seed(seed)
    model = LlamaFamily(cfg, hf_spec(cfg, name))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif n.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, float(cfg.get("initializer_range", 0.02)))
    return model
