import pytest

from libra.core.errors import ConfigError
from libra.costmodel.catalog import load_catalog

HARDWARE = ["a100-80g", "a800-80g", "h100-80g", "h200-141g", "rtx-pro-6000", "rtx-4090"]
MODELS = ["qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "qwen2.5-7b", "qwen2.5-72b",
          "llama-3.1-8b", "llama-3.1-70b"]  # fmt: skip

# Parameter counts published on the model cards (billions), to check the architecture math.
PUBLISHED_PARAMS_B = {"qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8, "qwen3-32b": 32.8,
                      "qwen3-30b-a3b": 30.5, "qwen2.5-7b": 7.6, "qwen2.5-72b": 72.7,
                      "llama-3.1-8b": 8.0, "llama-3.1-70b": 70.6}  # fmt: skip


def test_all_shipped_entries_present(catalog):
    assert set(HARDWARE) <= set(catalog.hardware_specs)
    assert set(MODELS) <= set(catalog.model_specs)


@pytest.mark.parametrize("name", MODELS)
def test_param_count_matches_model_card(catalog, name):
    got = catalog.model(name).total_params / 1e9
    assert got == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.03)


def test_moe_active_params(catalog):
    m = catalog.model("qwen3-30b-a3b")
    assert m.is_moe
    # "A3B": about 3.3B active parameters including the LM head.
    assert 2.8e9 < m.active_matmul_params < 3.8e9


def test_kv_bytes_qwen3_14b(catalog):
    # 2 (K,V) x 40 layers x 8 kv heads x 128 dims x 2 bytes
    assert catalog.model("qwen3-14b").kv_bytes_per_token == 163840


def test_unknown_name_lists_known(catalog):
    with pytest.raises(ConfigError) as e:
        catalog.hardware("b300")
    assert "a800-80g" in str(e.value) and "b300" in str(e.value)


def test_user_yaml_adds_and_overrides(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        "hardware:\n  - {name: my-gpu, memory_gib: 48, memory_bw_gbps: 900, bf16_tflops: 180,"
        " intra_node_bw_gbps: 32, intra_node_link: pcie, inter_node_bw_gbps: 12, gpus_per_node: 4}\n"
        "models:\n  - {name: tiny, layers: 2, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16,"
        " intermediate: 128, vocab: 256}\n"
    )
    cat = load_catalog([str(f)])
    assert cat.hardware("my-gpu").gpus_per_node == 4
    assert cat.model("tiny").layers == 2
    assert "a800-80g" in cat.hardware_specs  # shipped entries kept


@pytest.mark.parametrize(
    "text,needle",
    [
        ("hardware:\n  - {name: x, memory_gib: -1}\n", "memory_gib"),
        ("models: 3\n", "models"),
        ("gpus: []\n", "gpus"),
        ("hardware: [\n", "YAML"),
        (
            "models:\n  - {name: m, layers: 2, hidden: 64, heads: 5, kv_heads: 2, head_dim: 8, intermediate: 8, vocab: 8}\n",
            "kv_heads",
        ),
    ],
)
def test_bad_user_yaml_is_a_config_error(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_catalog([str(f)])
    assert needle in str(e.value)
