"""LoRA on a checkpoint model (peft), and the adapter as the engines receive it.

The trainer injects peft's LoRA layers into its `LlamaFamily` (`peft.inject_adapter_in_model`: it
works on any torch module whose linear layers carry the usual names) and freezes the rest. What it
publishes is the adapter alone: a `state_dict` file of `<module>.lora_A.weight` and
`<module>.lora_B.weight` tensors under the engine model's own module names, plus `lora.scale`
(alpha / r). An engine keeps its base weights and sets each adapted weight to
`base + scale * B @ A` (`hf_model.LlamaFamily.apply_adapter`), so a publication moves megabytes,
not the whole model, and the engine's forward pass stays the plain one.
"""

from __future__ import annotations

import torch
from torch import nn

from libra.runtime.train.config import LoraSettings

SCALE = "lora.scale"


def add_lora(model: nn.Module, cfg: LoraSettings) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=list(cfg.targets), lora_dropout=0.0, bias="none")  # fmt: skip
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.lora_scale = cfg.alpha / cfg.r
    return model


def has_lora(model: nn.Module) -> bool:
    return hasattr(model, "lora_scale")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as published: `<module>.lora_A.weight` / `.lora_B.weight` (peft's adapter name
    dropped, so the names are the engine model's modules) and `lora.scale`."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]
            out[f"{module}.lora_{kind}.weight"] = t.detach().to("cpu", torch.float32).clone()
    out[SCALE] = torch.tensor(float(model.lora_scale))
    return out


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights under the plain names (what a checkpoint's `model.pt` holds)."""
    out = {}
    for name, t in model.state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out
