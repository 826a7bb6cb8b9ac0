"""The engine's model and tokenizer from its config: one call for every kind of model.

`load_lm(cfg)` gives the model the engine steps and the codec that turns text into its tokens and
back: the built-in `TinyTransformer` with the byte codec, or a Llama-family checkpoint
(`hf_model.LlamaFamily`) with its own tokenizer and chat template. Everything above (the core,
the runner, the HTTP front, the trainer) calls both through the same methods, whichever it is.
"""

from __future__ import annotations

import torch

from libra.runtime.engine.codec import BYTES, Codec
from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model, read_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_lm(cfg: EngineConfig) -> tuple[torch.nn.Module, Codec]:
    """(model, codec) for `cfg.model`, frozen for inference, on `cfg.device`; `cfg.checkpoint`
    (a `state_dict` file, as the trainer publishes) replaces the weights."""
    src = cfg.source
    if src.builtin:
        return build_model(src.spec, cfg.seed, cfg.checkpoint), BYTES
    from libra.runtime.engine.codec import load_tokenizer
    from libra.runtime.engine.hf_model import build_hf_model

    model = build_hf_model(src, cfg.seed, DTYPES[cfg.torch_dtype], cfg.device)
    if cfg.checkpoint is not None:
        state = read_checkpoint(model, cfg.checkpoint)
        model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False), load_tokenizer(src)
