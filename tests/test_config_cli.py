"""Configuration validation and the CLI's behaviour on good and bad input.

Real subprocesses, as a user runs them, for every behaviour; a table's further cases, once one
case has shown the behaviour in a real process, go through the same `libra.cli.main` in the test
process (conftest.run_main: a new interpreter is 0.5-1.5 CPU s of imports). Inputs that once hung
(a read that never ends, a FIFO) always get a real process, so a regression cannot wedge pytest."""

import json
import os
import resource
import stat

import pytest
from pydantic import BaseModel, Field

from libra.core.config import apply_overrides, build, load_model
from libra.core.errors import ConfigError
from tests.conftest import run_cli, run_main


class Small(BaseModel):
    tp: int = Field(1, ge=1)
    name: str = "x"


def test_overrides_parse_yaml_values():
    out = apply_overrides({"rollout": {"tp": 1}}, ["rollout.tp=4", "a.b.c=[1, 2]", "flag=true"])
    assert out == {"rollout": {"tp": 4}, "a": {"b": {"c": [1, 2]}}, "flag": True}


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, ["rollout.tp"])
    assert "KEY=VALUE" in str(e.value)


def test_override_through_scalar_is_an_error():
    with pytest.raises(ConfigError):
        apply_overrides({"a": 3}, ["a.b=1"])


def test_build_names_field_and_value():
    with pytest.raises(ConfigError) as e:
        build(Small, {"tp": 0}, prefix="rollout")
    assert e.value.field == "rollout.tp" and e.value.value == 0


def test_load_model_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tp: 2\nname: y\n")
    assert load_model(Small, f, ["tp=8"]) == Small(tp=8, name="y")


def test_malformed_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tp: [1,\n")
    with pytest.raises(ConfigError) as e:
        load_model(Small, f)
    assert "YAML" in str(e.value)


def test_rollout_json_fields():
    r = run_cli("costmodel", "rollout", "--hardware", "a800-80g", "--model", "qwen3-14b", "--tp", "1",
                "--batch", "64", "--context", "1024", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens_per_s"] == pytest.approx(64 / d["step_time_s"])
    assert d["kv_capacity_tokens"] > 0 and d["fits"] is True


def test_rollout_from_yaml_with_set(tmp_path):
    f = tmp_path / "q.yaml"
    f.write_text("model: qwen3-8b\ntp: 2\n")
    d = json.loads(run_cli("costmodel", "rollout", "--config", str(f), "--set", "tp=4", "--json").stdout)
    assert d["model"] == "qwen3-8b" and d["tp"] == 4


def test_train_json():
    r = run_cli(
        "costmodel", "train", "--tp", "8", "--dp", "2", "--seq-len", "8192", "--num-seqs", "64", "--json"
    )
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["fits"] is True and d["step_time_s"] > 0


REAL, HERE = "real process", "in-process"  # where a case runs (see the module docstring)


@pytest.mark.parametrize(
    "args,needle,how",
    [
        (["costmodel", "rollout", "--hardware", "b300"], "a800-80g", REAL),
        (["costmodel", "rollout", "--model", "gpt-9"], "qwen3-14b", HERE),
        (["costmodel", "rollout", "--tp", "16"], "gpus_per_node", HERE),
        (["costmodel", "rollout", "--batch", "0"], "batch", HERE),
        (["costmodel", "rollout", "--context", "-5"], "context", HERE),
        (["costmodel", "rollout", "--set", "nosuch=1"], "nosuch", HERE),
        (["costmodel", "rollout", "--tp", "abc"], "abc", HERE),
        (["costmodel", "train", "--pp", "3"], "pp", HERE),
        (
            ["costmodel", "train", "--model", "qwen3-14b", "--tp", "1", "--dp", "1", "--seq-len", "0"],
            "seq_len",
            HERE,
        ),
        (["costmodel", "nosuch"], "nosuch", HERE),
        (["costmodel", "rollout", "--config", "/nonexistent.yaml"], "nonexistent", HERE),
        # Each of these was a traceback, an hour of arithmetic, or a read that never ends:
        (["costmodel", "train", "--num-seqs", "99999999999999999999"], "num_seqs", HERE),
        (["costmodel", "train", "--dp", "99999999999999999999"], "dp", HERE),
        (["costmodel", "rollout", "--profile", "/dev/zero"], "not a regular file", REAL),
        (["costmodel", "catalog", "--catalog", "/dev/zero"], "not a regular file", REAL),
        (["plan", "--trace", "/dev/zero"], "not a regular file", REAL),
        # An --out that cannot be written is refused before the work, not after it (a traceback):
        (["simulate", "--steps", "1", "--out", "/proc/libra-out"], "a directory this user can write", HERE),
        (
            ["costmodel", "calibrate", "--data", "/dev/null", "--out", "/nonexistent/p.yaml"],
            "a writable file path",
            HERE,
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle, how):
    r = run_cli(*args) if how == REAL else run_main(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_binary_files_are_one_line_errors(tmp_path):
    """A config, catalog, profile or trace of bytes that are not UTF-8 was a UnicodeDecodeError."""
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(128, 256)) * 4)
    for args, needle in [
        (["costmodel", "rollout", "--config", str(junk)], "not UTF-8"),
        (["costmodel", "catalog", "--catalog", str(junk)], "not UTF-8"),
        (["plan", "--profile", str(junk)], "not UTF-8"),
        (["simulate", "--trace", str(junk), "--steps", "1"], "junk.bin:1"),
    ]:
        r = run_cli(*args) if "rollout" in args else run_main(*args)  # one real process
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_input_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in (["plan", "--trace", str(fifo)], ["costmodel", "catalog", "--catalog", str(fifo)]):
        r = run_cli(*args)  # opening a FIFO waits for a writer that never comes: run_cli's timeout
        assert r.returncode == 2 and "not a regular file" in r.stderr, (args, r.stderr)


def test_an_output_path_that_is_a_device_is_refused_not_replaced(tmp_path):
    """`trace generate` writes beside --out and renames over it: run as root with --out /dev/full,
    that replaced the device with a regular file. A FIFO stands in for the device here (the real
    test must not risk /dev/null)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in (["trace", "generate", "--family", "search-r1", "--out", str(fifo)],
                 ["costmodel", "calibrate", "--data", "/dev/null", "--out", str(fifo)]):  # fmt: skip
        r = run_cli(*args)
        assert r.returncode == 2 and "regular file" in r.stderr, (args, r.stderr)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_large_training_batch_does_not_hang():
    """Dealing 65536 sequences over 65536 DP ranks was quadratic (minutes); it is a heap now.
    Checked on the command's CPU seconds, not on the wall clock, so a loaded machine cannot fail
    it: ~0.7 s with the heap, ~68 s with the old list scan (its first 8192 sequences took 8.5 s).
    Not a speed goal (that is benchmarks/bench_planner.py); run_cli's timeout is the hang guard."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run_cli("costmodel", "train", "--dp", "65536", "--num-seqs", "65536", "--json")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"] == 65536
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu_s < 20, cpu_s


def test_malformed_yaml_cli(tmp_path):
    f = tmp_path / "q.yaml"
    f.write_text("tp: [\n")
    r = run_cli("costmodel", "rollout", "--config", str(f))
    assert r.returncode == 2 and "YAML" in r.stderr and "Traceback" not in r.stderr


def test_every_command_has_help():
    r = run_cli("--help")  # the real process; each command's own help in this one
    assert r.returncode == 0
    for cmd in ["costmodel"]:
        assert cmd in r.stdout
        assert run_main(cmd, "--help").returncode == 0
    for sub in ["rollout", "train", "catalog", "calibrate", "report"]:
        assert run_main("costmodel", sub, "--help").returncode == 0
