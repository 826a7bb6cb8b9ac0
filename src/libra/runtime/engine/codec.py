"""Token ids <-> text, and the chat template: the one interface the engine speaks to any tokenizer.

Two codecs behind one protocol, so the sequence outputs, the sampler and the HTTP front never ask
which model they serve:

- `ByteCodec`: the built-in model's byte-level tokenizer and template (`tokenizer.py`). Its tool
  calls are generated under the engine's grammar, inside special envelope tokens.
- `HFCodec`: a Hugging Face tokenizer (from a checkpoint directory or a GGUF file) and the model's
  own chat template (jinja, through `apply_chat_template`). Tool calls are the model's to write, in
  the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in its text, parsed
  when the turn ends (`HermesOutput`). When the template renders tools itself (Qwen2.5, Qwen3,
  Llama 3.1), it is given the tools and the calls; when it does not (SmolLM2's plain ChatML), the
  tools are described Hermes-style in the system turn, a call is written back as that markup and
  a tool result as a `tool` turn wrapped in `<tool_response>`.

Every token has its bytes (`token_bytes`): the UTF-8 bytes it adds to the text (none for a
special token). Sequence outputs build text from these bytes, so a character split over two
tokens, and a stop string split over tokens, come out exactly as in the built-in engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import Protocol

from libra.runtime.engine import tokenizer as byte_tok
from libra.runtime.engine.tokenizer import NUM_BYTES, SPECIAL_TEXT, ChatMessage


class Codec(Protocol):
    vocab_size: int
    tool_format: str  # "grammar": the engine writes the envelope; "hermes": the model writes calls in text

    def token_bytes(self, token: int) -> bytes: ...

    def is_special(self, token: int) -> bool: ...

    def ends_text(self, token: int) -> bool: ...

    def label(self, token: int) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def render(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[ChatMessage], tools: list | None) -> list[int]: ...

    def prompt(self, text: str) -> list[int]: ...


class ByteCodec:
    """The built-in model's bytes and special tokens."""

    vocab_size = byte_tok.VOCAB_SIZE
    tool_format = "grammar"
    end_ids = frozenset({int(byte_tok.Special.END)})

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if token < NUM_BYTES else b""

    def is_special(self, token: int) -> bool:
        return token >= NUM_BYTES

    def ends_text(self, token: int) -> bool:
        return token >= NUM_BYTES

    def label(self, token: int) -> str:
        if token < NUM_BYTES:
            return bytes((token,)).decode("utf-8", errors="replace")
        return SPECIAL_TEXT.get(token, f"<|unused{token}|>")

    def encode(self, text: str) -> list[int]:
        return byte_tok.encode(text)

    def render(self, ids: Sequence[int]) -> str:
        return byte_tok.render(ids)

    def chat(self, messages: Sequence[ChatMessage], tools: list | None) -> list[int]:
        return byte_tok.render_chat(messages, tools)

    def prompt(self, text: str) -> list[int]:
        return byte_tok.render_prompt(text)


BYTES = ByteCodec()


class IdsOnly:
    """A vocabulary with no text: token ids in and out, no end token. For engines that serve
    random weights of a real shape (throughput benchmarks, the device script), where there is no
    tokenizer: every token is text of no bytes, and a sequence runs to its max_tokens."""

    tool_format = "hermes"

    def __init__(self, vocab_size: int):
        self.vocab_size, self.end_ids = vocab_size, frozenset()

    def token_bytes(self, token: int) -> bytes:
        return b""

    def is_special(self, token: int) -> bool:
        return False

    def ends_text(self, token: int) -> bool:
        return False

    def label(self, token: int) -> str:
        return f"<{token}>"

    def encode(self, text: str) -> list[int]:
        raise ValueError("this engine has no tokenizer: send token ids")

    def render(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def chat(self, messages: Sequence[ChatMessage], tools: list | None) -> list[int]:
        raise ValueError("this engine has no tokenizer or chat template: send token ids")

    def prompt(self, text: str) -> list[int]:
        return self.encode(text)


# ---- Hugging Face tokenizers ------------------------------------------------------------------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_SYSTEM = (
    "You can call functions. Their signatures are listed inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, write a JSON object with its name and arguments inside <tool_call></tool_call>, like this:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def hermes_call(name: str, arguments: str) -> str:
    """A call as it is written back into the conversation (and as the parser reads it)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{TOOL_CALL_CLOSE}"


def parse_hermes(text: str) -> tuple[str, str, str] | None:
    """(content before the call, name, arguments JSON) of the first well-formed call, or None."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = text[start + len(TOOL_CALL_OPEN) :]
    end = body.find(TOOL_CALL_CLOSE)
    body = body[:end] if end >= 0 else body
    try:
        call = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return text[:start], call["name"], args if isinstance(args, str) else json.dumps(args)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in of each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))  # fmt: skip
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HFCodec:
    """A `transformers` tokenizer with the model's chat template."""

    tool_format = "hermes"

    def __init__(self, tok, vocab_size: int):
        self.tok, self.vocab_size = tok, vocab_size
        self.special = frozenset(int(i) for i in tok.all_special_ids) | frozenset(
            int(i) for i, t in tok.added_tokens_decoder.items() if t.special
        )
        self.end_ids = self._end_ids()
        self._bytes = self._token_bytes_table()

    def _end_ids(self) -> frozenset[int]:
        """The tokens that end a turn: EOS, and the template's end-of-turn marker (<|im_end|>,
        <|eot_id|>, <|end|>) when it has one."""
        ids = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>"):
            i = self.tok.convert_tokens_to_ids(marker)
            if isinstance(i, int) and i != self.tok.unk_token_id and i in self.special:
                ids.add(i)
        return frozenset(ids)

    def _token_bytes_table(self) -> list[bytes]:
        """Each token's bytes: byte-level BPE (GPT-2's alphabet) or SentencePiece (▁ and <0xNN>)."""
        pieces = self.tok.convert_ids_to_tokens(list(range(len(self.tok))))
        dec = _byte_decoder()
        byte_level = sum(p is not None and all(c in dec for c in p) for p in pieces) > 0.9 * len(pieces)
        out: list[bytes] = []
        for i, p in enumerate(pieces):
            if p is None or i in self.special:
                out.append(b"")
            elif byte_level and all(c in dec for c in p):
                out.append(bytes(dec[c] for c in p))
            elif p.startswith("<0x") and p.endswith(">") and len(p) == 6:
                out.append(bytes((int(p[3:5], 16),)))
            else:
                out.append(p.replace("▁", " ").encode())
        return out + [b""] * max(0, self.vocab_size - len(out))

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token] if token < len(self._bytes) else b""

    def is_special(self, token: int) -> bool:
        return token in self.special or token >= len(self.tok)

    def ends_text(self, token: int) -> bool:
        return token in self.end_ids

    def label(self, token: int) -> str:
        if self.is_special(token):
            return self.tok.convert_ids_to_tokens(token) or f"<|unused{token}|>"
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def render(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def prompt(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    @cached_property
    def native_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else they go in the system turn)."""
        template = self.tok.chat_template
        return isinstance(template, str) and "tools" in template

    def chat(self, messages: Sequence[ChatMessage], tools: list | None) -> list[int]:
        convo = self.conversation(messages, tools)
        kwargs = {"tools": tools} if tools and self.native_tools else {}
        text = self.tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.encode(text)

    def conversation(self, messages: Sequence[ChatMessage], tools: list | None) -> list[dict]:
        """The messages as the template reads them; tools Hermes-style when it cannot."""
        native = self.native_tools
        out: list[dict] = []
        for m in messages:
            role = "system" if m.role == "developer" else m.role
            if role == "assistant" and m.tool_calls:
                out.append(self._assistant(m, native))
            elif role == "tool" and not native:
                out.append({"role": "tool", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
            elif role == "tool":
                out.append({"role": "tool", "content": m.content, "tool_call_id": m.tool_call_id or ""})
            else:
                out.append({"role": role, "content": m.content})
        if tools and not native:
            listed = "\n".join(json.dumps(t) for t in tools)
            preamble = HERMES_SYSTEM.format(tools=listed)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out

    @staticmethod
    def _assistant(m: ChatMessage, native: bool) -> dict:
        """A turn with calls: its own text when it already holds the markup (what the model wrote,
        sent back verbatim so the tokens the model sampled come back unchanged), else rendered."""
        if TOOL_CALL_OPEN in m.content or not native:
            text = m.content if TOOL_CALL_OPEN in m.content else "\n".join(
                [m.content, *(hermes_call(c.name, c.arguments) for c in m.tool_calls)]
            ).lstrip("\n")  # fmt: skip
            return {"role": "assistant", "content": text}
        calls = [{"type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}} for c in m.tool_calls]  # fmt: skip
        return {"role": "assistant", "content": m.content, "tool_calls": calls}


def _json_or_text(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def load_tokenizer(src) -> HFCodec:
    """The tokenizer of a Hugging Face directory or GGUF file (`sources.ModelSource`), local only."""
    from transformers import AutoTokenizer

    from libra.runtime.engine.sources import converted

    done = converted(src.path) if src.kind == "gguf" else None
    if done is not None:  # the conversion's own copy (hf_model.load_gguf)
        tok = AutoTokenizer.from_pretrained(str(done), local_files_only=True)
    elif src.kind == "gguf":
        tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(src.path), local_files_only=True)
    return HFCodec(tok, src.spec.vocab_size)
