"""Real models' code path on a tiny randomly initialised Hugging Face checkpoint (written here by
transformers, nothing downloaded): loading, logprob parity against a transformers forward, the
engine serving it over HTTP (continuous batching on the paged cache, token ids and logprobs,
Hermes tool calls), one training step and a weight publication with a version check.

One engine subprocess for the module (its start pays the transformers import once).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from libra.core.errors import ConfigError  # noqa: E402
from libra.runtime.engine.codec import HFCodec, load_tokenizer, parse_hermes  # noqa: E402
from libra.runtime.engine.config import EngineConfig  # noqa: E402
from libra.runtime.engine.hf_model import build_hf_model  # noqa: E402
from libra.runtime.engine.model import token_logprobs  # noqa: E402
from libra.runtime.engine.sequence import HermesOutput, SeqEvent, TextOutput  # noqa: E402
from libra.runtime.engine.sources import resolve  # noqa: E402
from tests.engine_fixtures import start_engine  # noqa: E402
from tests.hf_fixtures import write_checkpoint  # noqa: E402

TOL = 1e-4
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_logprobs(ref, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one transformers forward."""
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_each_architecture_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(tmp_path / arch, arch)
    src = resolve(str(path))
    assert src.kind == "hf" and src.spec.arch == arch and src.spec.n_kv_heads == 2  # from config.json
    ours = build_hf_model(src)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    toks = torch.randint(0, src.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = (
            torch.log_softmax(ref(toks).logits[:, :-1].float(), -1).gather(-1, toks[:, 1:, None]).squeeze(-1)
        )
        got = token_logprobs(ours, toks)
    assert (got - want).abs().max().item() < TOL


def test_bad_models_are_one_clear_error(tmp_path, ckpt):
    with pytest.raises(ConfigError, match="no such file"):
        resolve(str(tmp_path / "nope"))
    cfg = json.loads((ckpt / "config.json").read_text())
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="supported architecture.*'gpt2'"):
        resolve(str(other))
    from libra.runtime.engine import sources

    monkey = {**sources.PACKAGED, "smollm2-135m": ("libra_no_such_package", "*.gguf")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources, "PACKAGED", monkey)
        with pytest.raises(ConfigError, match="the 'models' extra installed .*libra_no_such_package"):
            resolve("smollm2-135m")
    with pytest.raises(ConfigError, match="^model: got '/nonexistent/m'; allowed: a preset"):
        EngineConfig(model="/nonexistent/m")
    with pytest.raises(ConfigError, match="engine.model"):
        from libra.runtime.train.config import load_train_config

        load_train_config(None, ["engine.model=/nonexistent/m"])


def test_hermes_calls_are_parsed_from_text(ckpt):
    codec = load_tokenizer(resolve(str(ckpt)))
    assert isinstance(codec, HFCodec) and codec.tok.eos_token_id in codec.end_ids
    text = 'Sure.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "17+25"}}\n</tool_call>'
    assert parse_hermes(text) == ("Sure.\n", "calc", '{"expr": "17+25"}')
    out, ev = HermesOutput(TextOutput(codec=codec)), SeqEvent(0)
    reasons = [out.feed(t, ev) for t in [*codec.encode(text), codec.tok.eos_token_id]]
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    assert (
        ev.text == "Sure.\n" and ev.tool_call[1] == "calc" and json.loads(ev.tool_args) == {"expr": "17+25"}
    )
    # Tools are described Hermes-style in the system turn (the template has none of its own),
    # and the model's call, sent back verbatim, renders as the very tokens it sampled.
    prompt = codec.chat([], [CALC])
    assert "<tools>" in codec.render(prompt) and '"calc"' in codec.render(prompt)


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    eng = start_engine("--model", str(ckpt), "--kv-cache-mb", "4", "--max-num-seqs", "8", name="tiny-hf",
                       log_dir=tmp_path_factory.mktemp("engine"), timeout=180)  # fmt: skip
    yield eng
    eng.stop()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_served_logprobs_equal_a_transformers_forward(engine, reference):
    """Four concurrent chats (continuous batching, paged KV): every sampled token's logprob is
    what transformers computes over the prompt and the tokens before it."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> dict:
        msgs = [{"role": "user", "content": f"What is {i}7+25? " * (i + 1)}]
        return post(engine.url + "/v1/chat/completions", {"model": "tiny-hf", "messages": msgs, "max_tokens": 12,
                    "temperature": 1.0, "seed": i, "logprobs": True, "return_token_ids": True, "ignore_eos": True})  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for a in answers:
        prompt, choice = a["prompt_token_ids"], a["choices"][0]
        ids, lps = choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
        assert len(ids) == 12 and len(lps) == 12
        want = hf_logprobs(reference, prompt + ids)[len(prompt) - 1 :]
        assert max(abs(x - y) for x, y in zip(lps, want, strict=True)) < TOL
    health = engine.get("/health")
    assert health["max_model_len"] == 512 and health["steps"] > 0


def test_train_step_and_publication_with_a_version(engine, ckpt, tmp_path, reference):
    """One GRPO step of the trainer's own code on the checkpoint model, its state_dict published
    to the engine from disk under version 7: the engine then reports 7 and its logprobs are the
    trained weights'."""
    from libra.runtime.train.batch import TrainSample
    from libra.runtime.train.config import load_train_config
    from libra.runtime.train.grpo import Clip
    from libra.runtime.train.learner import Learner, OptimConfig
    from libra.runtime.train.models import train_model
    from libra.runtime.train.reducer import LocalReducer

    cfg = load_train_config(None, [f"engine.model={ckpt}", "engine.kv_cache_mb=17"])
    learner = Learner(None, 0, OptimConfig(lr=1e-2), LocalReducer(), train_model(cfg, 0))
    ids = [int(t) for t in torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))]
    old = [0.0, *hf_logprobs(reference, ids)]
    sample = TrainSample(ids=ids, mask=[0] * 10 + [1] * 10, logprobs=old, advantage=1.0)
    stats = learner.rl_step([sample], 10, Clip())
    assert stats.tokens == 10 and stats.logprob_diff_max < TOL  # trainer == transformers before the step
    path = tmp_path / "model.pt"
    torch.save(learner.model.state_dict(), path)
    out = post(engine.url + "/update_weights_from_disk", {"model_path": str(path), "weight_version": "7"})
    assert out["success"] and out["weight_version"] == "7"
    assert engine.get("/get_weight_version")["weight_version"] == "7"
    a = post(engine.url + "/v1/completions", {"model": "tiny-hf", "prompt": ids[:10], "max_tokens": 4,
             "logprobs": 0, "return_token_ids": True, "temperature": 0})  # fmt: skip
    assert a["weight_version"] == "7"
    new = learner.logprobs([TrainSample(ids=ids[:10] + a["choices"][0]["token_ids"], mask=[0] * 14, logprobs=[0.0] * 14)])  # fmt: skip
    assert max(abs(x - y) for x, y in zip(a["choices"][0]["logprobs"]["token_logprobs"], new[0][10:], strict=True)) < TOL  # fmt: skip


def test_lora_trains_the_adapter_only_and_an_engine_merges_it(ckpt):
    """peft's LoRA on the checkpoint model: a step moves only the adapter; the adapter alone (what
    the trainer publishes) makes an engine's model compute the trained model's logprobs."""
    pytest.importorskip("peft")
    from libra.runtime.train.batch import TrainSample
    from libra.runtime.train.config import load_train_config
    from libra.runtime.train.grpo import Clip
    from libra.runtime.train.learner import Learner, OptimConfig
    from libra.runtime.train.lora import adapter_state
    from libra.runtime.train.models import train_model
    from libra.runtime.train.reducer import LocalReducer

    cfg = load_train_config(None, [f"engine.model={ckpt}", "engine.kv_cache_mb=17", "trainer.lora.r=4"])
    model = train_model(cfg, 0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    learner = Learner(None, 0, OptimConfig(lr=5e-2), LocalReducer(), model)
    ids = list(range(5, 25))
    sample = TrainSample(ids=ids, mask=[0] * 10 + [1] * 10, logprobs=[0.0, *learner.logprobs([TrainSample(ids=ids, mask=[0] * 20, logprobs=[0.0] * 20)])[0][1:]], advantage=1.0)  # fmt: skip
    for _ in range(2):  # peft starts B at zero: the second step moves the product
        learner.rl_step([sample], 10, Clip())
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if "lora_" not in n)
    adapter = adapter_state(model)
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) or k == "lora.scale" for k in adapter)
    engine_model = build_hf_model(resolve(str(ckpt))).eval()
    engine_model.check_adapter(adapter, "adapter", "model_path")
    assert engine_model.apply_adapter(adapter) == 2 * 4  # 2 layers x q, k, v, o
    toks = torch.tensor([ids])
    with torch.no_grad():
        want, got = token_logprobs(model.eval(), toks), token_logprobs(engine_model, toks)
    assert (got - want).abs().max().item() < TOL and (
        want - torch.tensor([sample.logprobs[1:]])
    ).abs().max() > 1e-3
