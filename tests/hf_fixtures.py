"""A tiny, randomly initialised Hugging Face checkpoint written by `transformers` in a test: the
same files a real model directory has (config.json, model.safetensors, tokenizer.json with a chat
template), so the engine and the trainer take the real models' code path with nothing downloaded.

The tokenizer is a byte-level BPE trained here on a few sentences (GPT-2's alphabet, as SmolLM2's
and Qwen's are), with ChatML's special tokens and SmolLM2's plain ChatML template (no tools: the
engine renders them Hermes-style).
"""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "What is 17 + 25? Answer with just the number. The answer is 42.",
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "17+25"}}\n</tool_call>',
    "<tool_response>\n42\n</tool_response> You can call functions. Their signatures are listed inside <tools></tools>",
    "the quick brown fox jumps over the lazy dog 0123456789 +-*/=() {}[]\"':,.?!",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer(vocab: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")  # fmt: skip
    fast.chat_template = CHATML
    return fast


CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def write_checkpoint(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2) -> Path:
    """A random `arch` model of 2 layers, hidden 64, 4 heads over 2 KV heads, saved with its
    tokenizer to `path` by transformers itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    extra = dict(CONFIGS[arch])
    model_type = extra.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # transformers zeroes biases: random ones, so the test sees them used
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
