"""The transformer of the built-in engine: a small pre-norm decoder (RMSNorm, RoPE, SwiGLU).

It is a real model, only small: every generated token goes through embedding, attention over the
paged KV cache and the output projection. One forward pass serves a whole continuous-batching
step: the linear layers run once over every token of the step (decodes and prefill chunks
flattened together), and attention is split into one batched call for all single-token decodes
plus one call per prefill chunk, so short decodes never pay for a long prompt's padding.

Each token's input is its own embedding plus an embedding of the token before it (`embed_prev`).
Why: the agentic tasks this engine is trained on are mostly copying (an operand from the question
into a tool call, a tool's result into the answer). Copying needs an induction circuit: attend to
the position after an earlier occurrence of the current token. Without the previous token in the
input, a 2-layer model must first grow a previous-token head in layer 1, a phase change whose
timing depends on the seed (the calculator warm-start broke through after 200 steps from one
seed and not within 475 from another); with it, one attention layer can key on "what preceded
me" directly (the "smeared key" of Olsson et al., 2022, or RWKV's token shift), and the same
warm-start copies from every seed tried (docs/train.md). `embed_prev` starts at zero, so a random
engine computes exactly what it did without it.

Weights are random (seeded) or loaded from a local `state_dict` file; nothing is downloaded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libra.core.errors import ConfigError
from libra.runtime.engine.kv_cache import KVCache
from libra.runtime.engine.presets import ModelPreset
from libra.runtime.regular_file import FileRefused, read_regular

NORM_EPS = 1e-5


@dataclass(slots=True)
class PrefillChunk:
    """A run of `n` prompt tokens of one sequence, starting at token row `row0` of the step."""

    row0: int
    n: int
    pos0: int
    blocks: Tensor | None  # [1, nb] cache blocks holding positions 0..pos0+n-1; None when pos0 == 0
    mask: Tensor | None  # [n, nb * block_size] causal mask offset by pos0; None when pos0 == 0


@dataclass(slots=True)
class StepBatch:
    """Where each token of one step sits and where it reads and writes the KV cache."""

    tokens: Tensor  # [T] long
    prev_tokens: Tensor  # [T] long: the token before each one in its sequence (vocab_size at position 0)
    positions: Tensor  # [T] long
    slots: Tensor  # [T] long: the cache slot each token's key and value are written to
    n_decode: int  # rows [0, n_decode) are single-token decodes, attended in one batched call
    decode_blocks: Tensor | None  # [B, nb] cache blocks of each decode's context (null-padded)
    decode_mask: Tensor | None  # [B, 1, 1, nb * block_size] True where a key is in the context
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_rows: Tensor | None = None  # [S] rows whose next-token logits are wanted
    block_size: int = 16


class Block(nn.Module):
    def __init__(self, p: ModelPreset):
        super().__init__()
        self.p = p
        self.attn_norm = nn.Parameter(torch.ones(p.d_model))
        self.qkv = nn.Linear(p.d_model, 3 * p.d_model, bias=False)
        self.out = nn.Linear(p.d_model, p.d_model, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(p.d_model))
        self.gate_up = nn.Linear(p.d_model, 2 * p.d_ff, bias=False)
        self.down = nn.Linear(p.d_ff, p.d_model, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], b: StepBatch, kc: Tensor, vc: Tensor) -> Tensor:
        p, t = self.p, x.shape[0]
        h = F.rms_norm(x, (p.d_model,), self.attn_norm, NORM_EPS)
        q, k, v = self.qkv(h).view(t, 3, p.n_heads, p.head_dim).unbind(1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kc.index_copy_(0, b.slots, k)
        vc.index_copy_(0, b.slots, v)
        x = x + self.out(attention(q, k, v, b, kc, vc).reshape(t, p.d_model))
        h = F.rms_norm(x, (p.d_model,), self.mlp_norm, NORM_EPS)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward_train(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """x: [B, T, d_model] of whole sequences from position 0; causal attention, no cache.

        The same weights and operations as `forward` (norms, RoPE, SDPA, SwiGLU), so the
        trainer's log-probabilities match the engine's to float rounding.
        """
        p, (b, t) = self.p, x.shape[:2]
        h = F.rms_norm(x, (p.d_model,), self.attn_norm, NORM_EPS)
        q, k, v = self.qkv(h).view(b, t, 3, p.n_heads, p.head_dim).unbind(2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(o.transpose(1, 2).reshape(b, t, p.d_model))
        h = F.rms_norm(x, (p.d_model,), self.mlp_norm, NORM_EPS)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, b: StepBatch, kc: Tensor, vc: Tensor) -> Tensor:
    """q: [T, H, D], k, v: [T, KVH, D] for this step's tokens; kc, vc: the layer's cache
    [slots, KVH, D]. With fewer KV heads than query heads (grouped-query attention), each KV head
    serves H / KVH consecutive query heads, as in transformers' `repeat_kv`."""
    out = torch.empty_like(q)
    nd, gqa = b.n_decode, k.shape[1] != q.shape[1]
    if nd:
        keys, vals = _gather(kc, b.decode_blocks, b.block_size), _gather(vc, b.decode_blocks, b.block_size)
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype), attn_mask=b.decode_mask, enable_gqa=gqa)  # fmt: skip
        out[:nd] = o.squeeze(2)
    for c in b.prefills:
        rows = slice(c.row0, c.row0 + c.n)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if c.blocks is None:  # a fresh prompt: its own keys are the whole context
            ks, vs = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            ks, vs = _gather(kc, c.blocks, b.block_size), _gather(vc, c.blocks, b.block_size)
            o = F.scaled_dot_product_attention(
                qs, ks.to(q.dtype), vs.to(q.dtype), attn_mask=c.mask, enable_gqa=gqa
            )
        out[rows] = o[0].transpose(0, 1)
    return out


def _gather(cache: Tensor, blocks: Tensor, block_size: int) -> Tensor:
    """The cache rows of `blocks` [B, nb] as [B, H, nb * block_size, D].

    Whole blocks, not single slots, and `index_select`, not fancy indexing: copying a few large
    rows is several times faster on CPU than copying many small ones.
    """
    b, nb = blocks.shape
    rows = cache.view(-1, block_size * cache.shape[1] * cache.shape[2])
    return rows.index_select(0, blocks.reshape(-1)).view(b, nb * block_size, *cache.shape[1:]).transpose(1, 2)


# Embedding scales of the seeded init. The engine's random weights use a unit-scale embedding, so
# that a random model's next-token distribution depends visibly on its input (what batching and
# cache tests need to catch mistakes). A model that is trained starts from GPT-2's 0.02: with unit
# embeddings, every token's content swamps what attention needs for positional copying, and the
# calculator task's warm-start did not learn to copy an operand in 600 steps; at 0.02 it copies
# the expression after 300 (docs/train.md, "What the model learns").
ENGINE_EMBED_STD = 1.0
TRAIN_EMBED_STD = 0.02


class TinyTransformer(nn.Module):
    def __init__(self, preset: ModelPreset, seed: int = 0, embed_std: float = ENGINE_EMBED_STD):
        super().__init__()
        self.preset = p = preset
        self.embed = nn.Embedding(p.vocab_size, p.d_model)
        self.layers = nn.ModuleList(Block(p) for _ in range(p.n_layers))
        self.final_norm = nn.Parameter(torch.ones(p.d_model))
        self.lm_head = nn.Linear(p.d_model, p.vocab_size, bias=False)
        # Row vocab_size stands for "no token before" (a sequence's first position).
        self.embed_prev = nn.Embedding(p.vocab_size + 1, p.d_model)
        inv_freq = 1.0 / (p.rope_theta ** (torch.arange(0, p.head_dim, 2).float() / p.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.init_weights(seed, embed_std)

    @torch.no_grad()
    def init_weights(self, seed: int, embed_std: float = ENGINE_EMBED_STD) -> None:
        """Seeded GPT-2 style init, so `--seed` alone fixes every weight on every machine."""
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / (2 * self.preset.n_layers) ** 0.5
        for name, param in self.named_parameters():
            if name.startswith("embed_prev"):  # zero, and drawing nothing keeps the other weights
                continue
            if name.endswith("norm"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("out.weight", "down.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=g) * std)
        self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=g) * embed_std)
        self.embed_prev.weight.zero_()

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def forward(self, b: StepBatch, cache: KVCache) -> Tensor:
        """Logits [S, vocab] for `b.sample_rows`, after writing every token's keys and values."""
        x = self.embed(b.tokens) + self.embed_prev(b.prev_tokens)
        rope = self.rope(b.positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, b, cache.k[i], cache.v[i])
        x = x if b.sample_rows is None else x[b.sample_rows]
        return self.lm_head(F.rms_norm(x, (self.preset.d_model,), self.final_norm, NORM_EPS))

    def forward_train(self, tokens: Tensor, rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Logits [B, T, vocab] for right-padded sequences `tokens` [B, T]: the trainer's forward.

        Cache-free and differentiable: every position attends causally to the positions before it,
        so padding at the right never reaches a real token. Row t predicts token t + 1. Given `rows`
        (a `nonzero(as_tuple=True)` of [B, T]) only those positions' logits [N, vocab]: the head
        and its gradient skip the prompt, which a large vocabulary makes a sizeable share.
        """
        prev = torch.cat([torch.full_like(tokens[:, :1], self.preset.vocab_size), tokens[:, :-1]], 1)
        x = self.embed(tokens) + self.embed_prev(prev)
        rope = self.rope(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer.forward_train(x, rope)
        x = x if rows is None else x[rows]
        return self.lm_head(F.rms_norm(x, (self.preset.d_model,), self.final_norm, NORM_EPS))


def token_logprobs(model: TinyTransformer, tokens: Tensor) -> Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, as [B, T - 1] (float32).

    Under the model's raw distribution, which is what the engine reports as a token's logprob
    (before the grammar's mask and the temperature), so the two compare directly.
    """
    logits = model.forward_train(tokens[:, :-1]).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def build_model(preset: ModelPreset, seed: int = 0, checkpoint: str | Path | None = None) -> TinyTransformer:
    model = TinyTransformer(preset, seed)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval().requires_grad_(False)


def save_checkpoint(model: TinyTransformer, path: str | Path) -> Path:
    """Write the model's `state_dict` (plain tensors, loadable with weights_only=True)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


def load_checkpoint(model: TinyTransformer, path: str | Path) -> None:
    model.load_state_dict(read_checkpoint(model, path), strict=True)


def read_checkpoint(model: TinyTransformer, path: str | Path, field: str = "checkpoint") -> dict[str, Tensor]:
    """The tensors of a `state_dict` file for `model`, checked against its shapes and for
    non-finite values, not loaded: a live engine copies them in between two steps. Only a regular
    file is read (a FIFO or a device is refused unopened: `regular_file`). Errors name `field`."""
    try:
        raw = read_regular(path)
    except FileRefused as e:
        raise ConfigError(field, str(path), f"an existing file, and a regular one ({e})") from None
    state = parse_state_dict(raw, str(path), field)
    if "lora.scale" in state and hasattr(model, "check_adapter"):  # a LoRA adapter (train/lora.py)
        model.check_adapter(state, str(path), field)
        return state
    _check_shapes(model, state, path, field)
    bad = first_non_finite(state)
    if bad is not None:
        raise ConfigError(field, str(path), f"finite weights ({bad} holds NaN or infinity)")
    return state


def parse_state_dict(raw: bytes, where: str, field: str) -> dict:
    """torch.load of a file's bytes (weights only: no pickled code runs); one clear error for
    anything torch cannot read, without torch's advice to load untrusted files unsafely."""
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a file that is not a checkpoint
        raise ConfigError(field, where, f"a torch state_dict file (torch could not read it: {type(e).__name__})") from None  # fmt: skip
    if not isinstance(state, dict):
        raise ConfigError(field, where, "a torch state_dict (a mapping of tensors)")
    return state


def first_non_finite(state: dict) -> str | None:
    """The first tensor of `state` holding NaN or an infinity, or None."""
    for name, t in state.items():
        if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _check_shapes(model: TinyTransformer, state: dict, path: str | Path, field: str = "checkpoint") -> None:
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    bad = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    if missing or extra or bad:
        detail = f"missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {bad[:3]}"
        raise ConfigError(field, str(path), f"a state_dict for model {model.preset.name!r} ({detail})")
