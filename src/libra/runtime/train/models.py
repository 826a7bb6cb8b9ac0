"""The model a trainer replica trains: the built-in model or a Llama-family checkpoint, built the
way the engines build theirs, so the trainer's log-probabilities are the engines' and a checkpoint
it saves is a `state_dict` the engines load as is.

- built-in preset: `TinyTransformer` from the run's seed at GPT-2's embedding scale (docs/train.md);
- a checkpoint (`engine.model`: a Hugging Face directory, a GGUF file, `smollm2-135m`): its
  `LlamaFamily` with the pretrained weights, on `trainer.device`, float32 on CPU and bfloat16 on
  CUDA unless `trainer.dtype` says otherwise; with `trainer.lora.r > 0`, peft's LoRA adapters on
  `trainer.lora.targets`, the base weights frozen (`lora.py`: only the adapter is published).
"""

from __future__ import annotations

import torch
from torch import nn

from libra.runtime.engine.model import TRAIN_EMBED_STD, TinyTransformer
from libra.runtime.engine.sources import resolve
from libra.runtime.train.config import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def train_dtype(cfg: TrainConfig) -> torch.dtype:
    t = cfg.trainer
    if t.dtype != "auto":
        return DTYPES[t.dtype]
    return torch.bfloat16 if t.device.startswith("cuda") else torch.float32


def train_model(cfg: TrainConfig, seed: int) -> nn.Module:
    """The replica's model, in training mode, on its device."""
    src = resolve(cfg.engine.model, cfg.engine.max_model_len, "engine.model")
    if src.builtin:
        return TinyTransformer(src.spec, seed, embed_std=TRAIN_EMBED_STD).train()
    from libra.runtime.engine.hf_model import build_hf_model

    model = build_hf_model(src, seed, train_dtype(cfg), cfg.trainer.device).train().requires_grad_(True)
    if cfg.trainer.lora.r > 0:
        from libra.runtime.train.lora import add_lora

        add_lora(model, cfg.trainer.lora)
    return model
