"""Per-step curves in TensorBoard and W&B (`libra.core.curves`), as RL users read them.

The TensorBoard files are read back record by record (TFRecord framing, CRC-32C checked, each
record an `Event` protobuf), which is what TensorBoard itself does; W&B runs offline and leaves
its run file in the run folder. `libra train`'s curves are checked by the live smoke run
(tests/test_train_live.py), which writes them every step.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import yaml

from libra.cli import main
from libra.core import curves as curves_mod
from libra.core.curves import CurveOptions, Curves, Toggle, flatten
from libra.core.errors import ConfigError
from tests.test_sim_pipeline import SMALL

pytest.importorskip("tensorboardX")


def read_events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the event files under `folder`."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        c = crc32c(data)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {folder}"
    for f in files:
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            head = data[pos : pos + 8]
            (n,) = struct.unpack("<Q", head)
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked(head), "length CRC"
            body = data[pos + 12 : pos + 12 + n]
            assert struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] == masked(body), "data CRC"
            pos += 16 + n
            ev = Event.FromString(body)
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_scalars_round_trip_through_the_event_file(tmp_path):
    c = Curves(tmp_path, CurveOptions(tensorboard=Toggle.ON), name="run")
    c.log(0, {"reward": 0.25, "loss/kl": 0.5, "skipped": None})
    c.log(1, {"reward": 0.75, "loss/kl": 0.125})
    c.close()
    got = read_events(tmp_path / "tb" / "run")
    assert got == {"reward": [(0, 0.25), (1, 0.75)], "loss/kl": [(0, 0.5), (1, 0.125)]}
    assert c.writers == ["tensorboard"]


def test_flatten_takes_numbers_and_bools_only():
    got = flatten("", {"a": 1, "b": {"c": 2.5, "d": True, "e": "text", "f": None, "g": [1, 2]}})
    assert got == {"a": 1.0, "b/c": 2.5, "b/d": 1.0}


def test_a_writer_asked_for_without_its_extra_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(curves_mod, "installed", lambda writer: False)
    with pytest.raises(ConfigError, match=r"libra\[wandb\]"):
        CurveOptions(wandb=Toggle.ON).resolve()
    assert CurveOptions().resolve() == (False, False)  # auto: quietly off without the extra
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--steps", "1", "--out", str(tmp_path), "--tensorboard"])
    assert e.value.code == 2 and "libra[tensorboard]" in capsys.readouterr().err


def test_simulate_writes_one_tensorboard_run_per_system(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump({**SMALL, "steps": 2}))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--scenario", str(scenario), "--systems", "static-uniform,verl-colocated",
              "--out", str(tmp_path / "out"), "--json"])  # fmt: skip
    assert e.value.code == 0
    for system in ("static-uniform", "verl-colocated"):
        got = read_events(tmp_path / "out" / "tb" / system)
        for tag in (
            "step_time_s",
            "throughput_tokens_per_s",
            "rollout_makespan_s",
            "staleness_max",
            "train_gpus",
        ):
            assert [s for s, _ in got[tag]] == [0, 1], (system, tag)


def test_wandb_offline_run_lands_in_the_run_folder(tmp_path):
    pytest.importorskip("wandb")
    c = Curves(
        tmp_path, CurveOptions(tensorboard=Toggle.OFF, wandb=Toggle.ON), name="run", config={"seed": 3}
    )
    c.log(0, {"reward": 0.5}, series="libra")
    c.log(1, {"reward": 0.7}, series="libra")
    c.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert b"libra/reward" in runs[0].read_bytes()


def test_tensorboard_curves_do_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch when it is installed (~2 CPU s, most of a short
    `libra simulate`); the curves take the writer without it. `False` also shows the block is gone:
    a `None` left in `sys.modules` would read as present, and break a later `import torch`."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from libra.core.curves import CurveOptions, Curves, Toggle\n"
        f"c = Curves(Path({str(tmp_path)!r}), CurveOptions(tensorboard=Toggle.ON), name='run')\n"
        "c.log(0, {'reward': 0.5}); c.close(); print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert read_events(tmp_path / "tb" / "run") == {"reward": [(0, 0.5)]}
