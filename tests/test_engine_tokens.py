"""Token in, token out: what an RL trainer reads from the built-in engine, checked against the
engine's own model.

A real `libra serve engine` subprocess is driven by the official `openai` client (vLLM's
`return_token_ids` through `extra_body`) and by a slime-shaped client of SGLang's `/generate`
(`input_ids`, `return_logprob`). For every answer: the token ids decode to the returned text, the
prompt ids are what the engine really fed the model, and each logprob equals the log-softmax of a
cache-free forward pass of the same weights over the prompt and the sampled ids.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from libra.runtime.engine.config import EngineConfig
from libra.runtime.engine.model import build_model
from libra.runtime.engine.tokenizer import ChatMessage, Special, decode, encode, render_chat, render_prompt
from tests.engine_fixtures import engine  # noqa: F401
from tests.test_engine_model import full_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(EngineConfig().preset, seed=0)  # the weights `engine` serves (seed 0)


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    with openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def post(url: str, body: dict | bytes, timeout: float = 60) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse_events(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [ln for ln in r.read().decode().split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def reference_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """log p(ids[i] | prompt + ids[:i]) from one cache-free forward over the whole sequence."""
    seq = prompt + ids
    logp = torch.log_softmax(full_logits(model, seq).float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL


# ---- vLLM's return_token_ids with the official client -------------------------------------------


def test_completions_token_ids_and_logprobs_match_the_model(client, model):
    r = client.completions.create(
        model="tiny", prompt="The answer is", max_tokens=24, temperature=1.0, seed=3, logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice, extra = r.choices[0], r.model_extra
    prompt = render_prompt("The answer is")
    assert choice.prompt_token_ids == prompt and extra["prompt_token_ids"] == prompt
    ids = choice.token_ids
    assert len(ids) == r.usage.completion_tokens and decode(ids) == choice.text
    assert_close(choice.logprobs.token_logprobs, reference_logprobs(model, prompt, ids))
    assert extra["weight_version"] == "0"


def test_chat_token_ids_logprobs_and_stream_agree(client, model):
    messages = [{"role": "user", "content": "hi there"}]
    kw = dict(model="tiny", messages=messages, max_tokens=20, temperature=0.8, seed=11)
    r = client.chat.completions.create(**kw, logprobs=True, extra_body={"return_token_ids": True})
    prompt = render_chat([ChatMessage("user", "hi there")])
    assert r.model_extra["prompt_token_ids"] == prompt
    ids = r.choices[0].model_extra["token_ids"]
    assert decode(ids) == r.choices[0].message.content
    assert_close([c.logprob for c in r.choices[0].logprobs.content], reference_logprobs(model, prompt, ids))
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
    assert streamed == ids  # the same seed samples the same tokens, streamed or not
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == r.choices[0].message.content


def test_tool_call_ids_hold_the_envelope(client):
    tool = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=[tool],
                                       tool_choice="required", extra_body={"return_token_ids": True})  # fmt: skip
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[0] == Special.TOOL_CALL and Special.TOOL_CALL_END in ids
    call = r.choices[0].message.tool_calls[0]
    assert decode(ids) == '{"name": "run", "arguments": ' + call.function.arguments + "}"


def test_token_id_prompts_single_and_batched(client, engine, model):  # noqa: F811
    ids = [5, 200, 17, 99, 3]  # any token ids, no BOS added: what the client sends is the prompt
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                  extra_body={"return_token_ids": True})  # fmt: skip
    assert r.choices[0].prompt_token_ids == ids and r.usage.prompt_tokens == 5
    assert_close(r.choices[0].logprobs.token_logprobs, reference_logprobs(model, ids, r.choices[0].token_ids))
    batch = [[1, 2, 3], [70, 80]]
    r = client.completions.create(
        model="tiny", prompt=batch, max_tokens=4, n=2, extra_body={"return_token_ids": True}
    )
    assert [c.prompt_token_ids for c in r.choices] == [batch[0], batch[0], batch[1], batch[1]]
    assert r.usage.prompt_tokens == 5 and "prompt_token_ids" not in r.model_extra
    for bad in ([300], [[1], []], [-1], [1, "a"]):
        status, body = post(engine.url + "/v1/completions", {"model": "tiny", "prompt": bad})
        assert status == 400 and body["error"]["param"].startswith("prompt"), body


def test_stop_strings_and_ids_keep_every_sampled_token(client):
    kw = dict(model="tiny", prompt="abc", max_tokens=200, temperature=1.0, seed=5)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[
        0
    ]
    stop = full.text[10:12]  # a stop string the same seed will meet
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]  # fmt: skip
    assert cut.finish_reason == "stop" and decode(cut.token_ids) == cut.text + stop
    kept = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True, "return_token_ids": True, "include_stop_str_in_output": True}).choices[0]  # fmt: skip
    assert kept.text == cut.text + stop and decode(kept.token_ids) == kept.text
    byte = full.token_ids[4]
    by_id = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [byte]}).choices[0]  # fmt: skip
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == byte and byte not in by_id.token_ids[:-1]


def test_logprob_tokens_as_ids(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=5, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})  # fmt: skip
    c = r.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]


# ---- sampling options: implemented, or refused naming the field ----------------------------------


def test_top_k_min_p_and_logit_bias(client):
    kw = dict(model="tiny", prompt="Once", max_tokens=30, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        for seed in (1, 2):
            r = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], **extra}}, temperature=1.0, seed=seed)  # fmt: skip
            assert r.choices[0].text == greedy, extra
    r = client.completions.create(**kw, temperature=0, logit_bias={str(ord("z")): 100})
    assert r.choices[0].text == "z" * 30
    first = greedy.encode()[0]
    r = client.completions.create(**kw, temperature=0, logit_bias={str(first): -100})
    assert r.choices[0].text.encode()[0] != first


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"999": 1}}, "logit_bias"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),  # more than it may make
        ("/generate", {"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ("/generate", {"sampling_params": {"nonsense": 1}}, "sampling_params.nonsense"),
        ("/generate", {"sampling_params": {"n": 2}}, "sampling_params.n"),
        ("/generate", {"logprob_start_len": 0}, "logprob_start_len"),
        ("/generate", {"input_ids": [1], "text": "a"}, "text"),
    ],
)
def test_unimplemented_options_are_refused_naming_the_field(engine, path, body, field):  # noqa: F811
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"model": "tiny", "prompt": "hi"}  # fmt: skip
    if path == "/generate":
        base = {"input_ids": [1, 2]}
    status, out = post(engine.url + path, {**base, **body})
    err = out["error"] if "error" in out else out
    assert status == 400 and err["param"] == field, out


def test_errors_never_echo_a_large_request(engine):  # noqa: F811
    body = {"model": "tiny", "prompt": list(range(200)) * 1000 + [999]}  # ~1 MB, one bad id at the end
    status, out = post(engine.url + "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "prompt" and len(json.dumps(out)) < 600


# ---- SGLang's /generate, as slime calls it -------------------------------------------------------


def test_slime_shaped_generate(engine, model):  # noqa: F811
    prompt = encode("Question: 2+2? Answer:")
    payload = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 40, "stop": None,
                            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                            "spaces_between_special_tokens": False, "sampling_seed": 7},
        "return_logprob": True,
    }  # fmt: skip
    status, out = post(engine.url + "/generate", payload, timeout=60)
    assert status == 200, out
    meta = out["meta_info"]
    ids = [item[1] for item in meta["output_token_logprobs"]]
    assert (
        ids == out["output_ids"]
        and meta["completion_tokens"] == len(ids)
        and meta["prompt_tokens"] == len(prompt)
    )
    assert_close([item[0] for item in meta["output_token_logprobs"]], reference_logprobs(model, prompt, ids))
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "0"
    text = out["text"].removesuffix("<|end|>")  # no_stop_trim with skip_special_tokens false keeps it
    assert decode(ids) == text
    if meta["finish_reason"]["type"] == "stop":
        assert ids[-1] == Special.END and meta["finish_reason"]["matched"] == Special.END
    again = post(engine.url + "/generate", payload)[1]
    assert again["output_ids"] == ids  # sampling_seed reproduces


def test_generate_text_batch_top_logprobs_and_stream(engine):  # noqa: F811
    body = {"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}  # fmt: skip
    status, out = post(engine.url + "/generate", body)
    assert status == 200 and isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]  # BOS + the text's bytes
    first = out[0]["meta_info"]
    assert first["finish_reason"] == {"type": "length", "length": 6}
    assert all(len(top) == 2 for top in first["output_top_logprobs"])
    assert first["output_token_logprobs"][0][2] == decode([first["output_token_logprobs"][0][1]])
    chunks = sse_events(engine.url + "/generate", {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert chunks[-1]["output_ids"] == out[0]["output_ids"] and chunks[-1]["text"] == out[0]["text"]
    assert all(len(a["output_ids"]) <= len(b["output_ids"]) for a, b in zip(chunks, chunks[1:], strict=False))


def test_tokenize_detokenize_and_model_card(engine):  # noqa: F811
    status, out = post(engine.url + "/tokenize", {"model": "tiny", "prompt": "hé"})
    assert status == 200 and out["tokens"] == render_prompt("hé") and out["count"] == 4
    assert out["max_model_len"] == 8192
    status, out = post(engine.url + "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert out["tokens"] == render_chat([ChatMessage("user", "x")])
    status, out = post(engine.url + "/detokenize", {"tokens": [int(Special.BOS), 104, 105]})
    assert out == {"prompt": "<|bos|>hi"}
    assert post(engine.url + "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    card = engine.get("/v1/models/tiny")
    assert card["max_model_len"] == 8192 and card["root"] == "tiny"
