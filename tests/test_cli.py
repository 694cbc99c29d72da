"""The `ktflow` command line, run as a subprocess: exit codes, output, files written."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import DATA


def ktflow(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ktflow", *map(str, args)], capture_output=True, text=True, env=e)


@pytest.mark.parametrize("sub", [[], ["compile"], ["run"], ["inspect"], ["demo"]])
def test_help_on_every_subcommand(sub):
    r = ktflow(*sub, "--help")
    assert r.returncode == 0 and "usage: ktflow" in r.stdout


def test_compile_inspect_run(demo_dir, tmp_path):
    plan = tmp_path / "plan.json"
    r = ktflow("compile", demo_dir, "-o", plan, "--hw", "cpu", "--max-seq-len", 64)
    assert r.returncode == 0, r.stderr
    assert "prefill" in r.stdout and "decode" in r.stdout and f"wrote {plan}" in r.stdout
    r = ktflow("inspect", plan, "--text")
    assert r.returncode == 0 and "L3.experts" in r.stdout and "instructions:" in r.stdout
    r = ktflow("run", demo_dir, "--plan", plan, "--input-ids", "1 2 3 4", "--max-new-tokens", 5, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    gen = json.loads(r.stdout.split("generated ids")[1].splitlines()[0])
    assert len(gen) == 5 and "decode:" in r.stdout and "tokens/s" in r.stdout


def test_greedy_steps_reach_the_plan_and_a_bad_value_is_one_line(demo_dir, tmp_path):
    plan = tmp_path / "plan.json"
    r = ktflow("compile", demo_dir, "-o", plan, "--hw", "cpu", "--max-seq-len", 64, "--greedy-steps", 3)
    assert r.returncode == 0, r.stderr
    assert json.loads(plan.read_text())["options"]["greedy_steps"] == 3
    r = ktflow("compile", demo_dir, "--hw", "cpu", "--max-seq-len", 64, "--greedy-steps", 0)
    assert r.returncode == 2 and "greedy_steps" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_run_trace_writes_the_measured_instructions_beside_the_predicted_format(demo_dir, tmp_path):
    """`run --trace`: the prompt step and the first decode step, every plan instruction with
    a measured time, as the Chrome trace `compile --trace` writes (here on the CPU, a hybrid plan
    whose GPU nodes run on the CPU with deferral)."""
    measured, predicted = tmp_path / "m.json", tmp_path / "p.json"
    args = ["--hw", "paper-a100", "--vram-budget-gb", "0.004", "--defer", "1", "--device", "cpu", "--max-seq-len", 64]
    r = ktflow("run", demo_dir, "--input-ids", "1 2 3 4", "--max-new-tokens", 3, "--ignore-eos", "--trace", measured,
               *args)
    assert r.returncode == 0, r.stderr
    assert "measured prefill (64-token plan) and decode step" in r.stdout
    assert ktflow("compile", demo_dir, "--trace", predicted, *args).returncode == 0
    got, want = (json.loads(p.read_text())["traceEvents"] for p in (measured, predicted))
    ran = {e["pid"] for e in got if e["ph"] == "X"}
    assert len(ran) == 2  # the prompt's bucket and decode: every other plan left out
    names = lambda evs: [(e["pid"], e["name"], e["cat"]) for e in evs if e["ph"] == "X" and e["pid"] in ran]  # noqa: E731
    assert names(got) == names(want)  # the same instructions, side by side
    assert any("(measured," in e["args"]["name"] for e in got if e["ph"] == "M")
    decode = [e for e in got if e["ph"] == "X" and e["pid"] == max(ran)]
    assert any(e["name"] == "L1.experts.def" for e in decode)
    assert all(e["dur"] >= 0 for e in decode) and sum(e["dur"] for e in decode if e["cat"] == "launch") > 0


def test_print_after(demo_dir):
    r = ktflow("compile", demo_dir, "--hw", "cpu", "--print-after", "annotate_costs")
    assert r.returncode == 0 and "# prefill4096 graph after annotate_costs" in r.stdout
    assert "L1.experts = routed_experts" in r.stdout


def test_explain_prints_the_placement_table():
    r = ktflow("compile", DATA / "deepseek-v3-config", "--hw", "paper-a100", "--explain")
    assert r.returncode == 0, r.stderr
    assert "placement (decode plan" in r.stdout and "GPU ridge" in r.stdout and "predicted peak VRAM" in r.stdout


def test_compile_full_size_deepseek_v3_config_only():
    r = ktflow("compile", DATA / "deepseek-v3-config", "--hw", "cpu")
    assert r.returncode == 0, r.stderr
    assert "deepseek_v3 (config only, no weights)" in r.stdout and "61 layers" in r.stdout


def test_prompt_with_tokenizer(demo_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "m"
    shutil.copytree(demo_dir, d)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2048)} | {"[UNK]": 2047}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    r = ktflow("run", d, "--prompt", "w5 w6 w7", "--max-new-tokens", 3, "--ignore-eos", "--hw", "cpu")
    assert r.returncode == 0, r.stderr
    assert "prompt ids    [5, 6, 7]" in r.stdout and "generated text" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["compile", "/nonexistent/dir"], "does not exist"),
    (["run", "{demo}", "--input-ids", "1 99999"], "token id 99999, outside the model's vocabulary (ids 0..2047)"),
    (["run", "{demo}", "--input-ids", "1,99999999999999999999999"], "token id 99999999999999999999999, outside"),
    (["run", "{demo}", "--input-ids", "1 x"], "--input-ids must be token ids"),
    (["run", "{demo}", "--input-ids", "1,,2"], "separated by one comma or spaces, got '1,,2'"),
    (["run", "{demo}", "--input-ids", "1,2", "--temperature", "0.7", "--seed", str(2**64)],
     "seed must be an integer in [-2**63, 2**64 - 1]"),
    (["run", "{demo}", "--prompt", "hi"], "tokenizer.json"),
    (["run", "{demo}", "--input-ids", "1 2", "--max-seq-len", "4", "--max-new-tokens", "10"], "max_seq_len 4"),
    (["inspect", "{demo}/config.json"], "not a ktflow plan"),
    (["compile", "{demo}", "--hw", "cpu", "-o", ""], "--output is empty: give a file path to write"),
    (["compile", "{demo}", "--hw", "cpu", "--trace", ""], "--trace is empty"),
])
def test_bad_input_exits_nonzero_with_a_clear_message(demo_dir, args, message):
    r = ktflow(*[a.replace("{demo}", str(demo_dir)) for a in args])
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_plan_written_to_dev_null_leaves_the_device_in_place(demo_dir):
    import stat

    before = os.stat("/dev/null").st_ino
    r = ktflow("compile", demo_dir, "--hw", "cpu", "-o", "/dev/null")
    assert r.returncode == 0, r.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and os.stat("/dev/null").st_ino == before


def test_failed_compile_writes_nothing(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 8}))
    out = tmp_path / "plan.json"
    r = ktflow("compile", d, "-o", out)
    assert r.returncode != 0 and "missing required field" in r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_demo_writes_once_then_reuses(tmp_path):
    env = {"KTFLOW_CACHE": str(tmp_path)}
    r = ktflow("demo", "--max-new-tokens", 4, "--prompt-tokens", 8, "--hw", "cpu", env=env)
    assert r.returncode == 0, r.stderr
    assert "wrote demo checkpoint" in r.stdout and "decode:" in r.stdout and "tokens/s" in r.stdout
    assert "decode:  3 tokens" in r.stdout  # every token timed (random weights: no stop at eos)
    d = tmp_path / "demo-deepseek-v3"  # a tokenizer beside it: `ktflow serve` takes the demo model
    assert (d / "tokenizer.json").is_file() and f"serve it: ktflow serve {d} --hw cpu" in r.stdout
    r = ktflow("demo", "--max-new-tokens", 4, "--prompt-tokens", 8, "--hw", "cpu", env=env)
    assert "using demo checkpoint" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-deepseek-v3"]


@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0, 1.5])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(demo_dir, delay):
    """Ctrl-C while the command's modules import (torch among them), compile or run: one line, 130."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "ktflow", "run", str(demo_dir), "--hw", "cpu", "--input-ids", "1,2",
                          "--max-new-tokens", "200", "--ignore-eos", "--max-seq-len", "256"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-800:])
    assert "Traceback" not in err and err.strip().endswith("interrupted"), err[-800:]
