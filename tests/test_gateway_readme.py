"""The README's Serve block runs as written: engines and a gateway in the background, a chat turn
with token ids, a slime-shaped /generate, a pause and a continue through the gateway, and the
servers stopped.

The block is run by bash from a scratch directory that links the repository's `.venv`, with one
change: its fixed ports (8101, 8102, 8000) become free ones, because tests never bind fixed ports.
The actions service's block (`sudo ...`) needs root and bubblewrap; its own suite starts it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
PORTS = ("8101", "8102", "8000")


def serve_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### `libra serve`") :]
    section = section[: section.index("\n### ", 1)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_the_readme_serve_block_runs_as_written(tmp_path):
    blocks = [b for b in serve_blocks() if not b.lstrip().startswith("sudo ")]
    assert len(blocks) == 1 and "kill $GW $E1 $E2" in blocks[0]
    script = blocks[0]
    for old, new in zip(PORTS, free_ports(len(PORTS)), strict=True):
        script = script.replace(old, str(new))
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "NO_COLOR": "1"})  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    finally:  # whatever happened, nothing the block started outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text + "\n" + "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    answers = [json.loads(line) for line in re.findall(r"^\{.*\}$", text, re.M)]
    chat, generate, paused, resumed = answers
    assert chat["prompt_token_ids"] and chat["choices"][0]["token_ids"] and chat["weight_version"] == "0"
    assert len(generate["output_ids"]) == len(generate["meta_info"]["output_token_logprobs"]) > 0
    assert paused["ok"] and len(paused["results"]) == 2 and resumed["ok"]


@pytest.mark.parametrize("doc", ["docs/gateway.md", "docs/engine.md"])
def test_the_docs_use_commands_that_exist(doc):
    """Every `libra serve ...` option a doc shows is one the command takes."""
    text = (ROOT / doc).read_text()
    for cmd in ("gateway", "engine"):
        help_text = run_cli("serve", cmd, "--help").stdout
        for opt in set(re.findall(rf"libra serve {cmd}[^\n`]*", text)):
            for flag in re.findall(r"(--[a-z][a-z-]+)", opt):
                assert flag in help_text, (doc, flag)
