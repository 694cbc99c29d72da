"""The CLI's error boundary: every failure is one line on stderr and an exit code (2 bad input,
1 the environment or an internal error, 130 Ctrl-C, 141 a closed pipe, quietly), a traceback
only with --debug; non-finite dense weights are named at load."""

import io
import subprocess
import sys

import pytest

import ktflow
from ktflow.tools import cli
from ktflow.errors import WeightError


def run_cli(capsys, *argv):
    capsys.readouterr()  # what fixtures printed before
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_input_is_exit_2_in_one_line(capsys, tmp_path):
    for argv in (["inspect", tmp_path], ["inspect", tmp_path / "missing.json"], ["compile", tmp_path]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and one_line(err) and err.startswith(f"ktflow {argv[0]}: error:"), (argv, err)


def test_an_output_path_that_is_a_directory(capsys, tmp_path, demo_dir):
    code, _, err = run_cli(capsys, "compile", demo_dir, "--hw", "cpu", "-o", tmp_path)
    assert code == 2 and one_line(err) and "is a directory" in err


@pytest.mark.parametrize("flag", [["--temperature", "nan"], ["--temperature", "-1"], ["--top-p", "nan"]])
def test_sampling_flags_are_checked(capsys, demo_dir, flag):
    code, _, err = run_cli(capsys, "run", demo_dir, "--hw", "cpu", "--input-ids", "1 2", "--max-new-tokens", 2, *flag)
    assert code == 2 and one_line(err) and flag[0].lstrip("-").replace("-", "_") in err


@pytest.mark.parametrize("exc,code,words", [
    (PermissionError(13, "Permission denied", "/x/plan.json"), 1, "Permission denied: /x/plan.json"),
    (OSError(28, "No space left on device"), 1, "No space left on device"),
    (MemoryError(), 1, "out of memory"),
    (ValueError("oops"), 1, "internal error: ValueError: oops"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_what_escapes_a_command_becomes_one_line(capsys, monkeypatch, tmp_path, exc, code, words):
    def boom(a):
        raise exc

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    got, _, err = run_cli(capsys, "inspect", tmp_path / "p.json")
    assert got == code and words in err and "Traceback" not in err


def test_debug_gives_the_traceback(capsys, monkeypatch, tmp_path):
    def boom(a):
        raise ValueError("oops")

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    for argv in (["--debug", "inspect", "p"], ["inspect", "p", "--debug"]):
        with pytest.raises(ValueError):
            cli.main(argv)
    monkeypatch.setenv("KTFLOW_DEBUG", "1")
    with pytest.raises(ValueError):
        cli.main(["inspect", "p"])


def test_a_closed_pipe_is_quiet(demo_dir, tmp_path):
    plan = tmp_path / "p.json"
    assert cli.main(["compile", str(demo_dir), "--hw", "cpu", "-o", str(plan)]) == 0
    r = subprocess.run(f"{sys.executable} -m ktflow inspect {plan} --text | head -1", shell=True, capture_output=True,
                       text=True)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and r.stderr == "", r.stderr


def _with_nan(src, dst, key):
    """A copy of checkpoint dir src with one NaN in tensor `key`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            tensors[key] = tensors[key].clone()
            tensors[key].view(-1)[7] = float("nan")
            save_file(tensors, f, metadata={"format": "pt"})
            return dst
    raise AssertionError(key)


def test_a_nan_in_a_dense_weight_is_named(capsys, tiny_dirs, tmp_path):
    d, _ = tiny_dirs("qwen3_moe")
    bad = _with_nan(d, tmp_path / "bad", "model.layers.1.self_attn.o_proj.weight")
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight.*non-finite value \(nan\)"):
        ktflow.compile(ktflow.load(bad), hw="cpu", dtype="float32", max_seq_len=16, backend="torch_ref").prepare()
    code, _, err = run_cli(capsys, "run", bad, "--hw", "cpu", "--input-ids", "1 2", "--max-new-tokens", 2)
    assert code == 2 and one_line(err) and "o_proj" in err


def test_a_nan_in_a_cpu_expert_is_named_with_its_layer(tiny_dirs, tmp_path, monkeypatch):
    from ktflow.backends.native import binding as native

    if not native.available():
        pytest.skip("needs the native module")
    monkeypatch.setenv("KTFLOW_CACHE_DIR", "off")
    d, _ = tiny_dirs("qwen3_moe")
    bad = _with_nan(d, tmp_path / "bad", "model.layers.1.mlp.experts.3.up_proj.weight")
    c = ktflow.compile(ktflow.load(bad), hw="cpu", dtype="bfloat16", max_seq_len=16, backend="native")
    with pytest.raises(WeightError, match=r"layer 1 .*expert 3 up: non-finite value at \[0, 7\]"):
        c.prepare()


def test_an_edited_or_damaged_plan_is_refused_at_load(capsys, tmp_path, demo_dir):
    """Structural damage fails the plan checks (inspect and run both exit 2 naming the rule); an
    attrs edit fails the comparison with the model's spec (run)."""
    import json

    plan = tmp_path / "p.json"
    assert cli.main(["compile", str(demo_dir), "--hw", "cpu", "--max-seq-len", "32", "-o", str(plan)]) == 0
    raw = json.loads(plan.read_text())

    def edited(change, name):
        r = json.loads(json.dumps(raw))
        change(r["decode"])
        out = tmp_path / name
        out.write_text(json.dumps(r))
        return out

    def drop_node(p):
        del p["graph"]["nodes"][5]

    def swap_instructions(p):
        s = p["instructions"]
        i = next(i for i, ins in enumerate(s) if ins["kind"] == "launch" and ins["reads"])
        j = next(j for j in range(i) if s[i]["reads"][0] in s[j]["writes"])
        s[i], s[j] = s[j], s[i]

    def bad_buffer(p):
        next(n for n in p["graph"]["nodes"] if "buffer" in n)["buffer"]["offset"] = 1 << 40

    def short_lived(p):  # a buffer freed before the instruction that writes it
        n = next(n for n in p["graph"]["nodes"] if "buffer" in n and n["buffer"]["first_instruction"] > 0)
        n["buffer"]["first_instruction"] = n["buffer"]["last_instruction"] = 0

    def untimed(p):
        del next(n for n in p["graph"]["nodes"] if n["inputs"])["timing"]

    for change, rule in ((drop_node, "V"), (swap_instructions, "K4"), (bad_buffer, "B3"), (short_lived, "K7"),
                         (untimed, "T1")):
        bad = edited(change, f"{rule}.json")
        for argv in (["inspect", bad], ["run", demo_dir, "--plan", bad, "--input-ids", "1 2"]):
            code, _, err = run_cli(capsys, *argv)
            assert code == 2 and one_line(err) and "fails verification" in err and f": {rule}" in err, (argv, err)

    def heads(p):
        next(n for n in p["graph"]["nodes"] if n["op"] == "attention")["attrs"]["heads"] += 1

    bad = edited(heads, "heads.json")
    code, _, err = run_cli(capsys, "run", demo_dir, "--plan", bad, "--input-ids", "1 2")
    assert code == 2 and one_line(err) and "does not match the model" in err and "heads" in err
    code, _, err = run_cli(capsys, "run", demo_dir, "--plan", plan, "--input-ids", "1 2", "--max-seq-len", "64")
    assert code == 2 and one_line(err) and "--max-seq-len" in err and "--plan fixes the compile options" in err


def test_unknown_backend_is_refused_at_compile(capsys, demo_dir):
    code, _, err = run_cli(capsys, "compile", demo_dir, "--hw", "cpu", "--backend", "cuda_grap")
    assert code == 2 and one_line(err) and "unknown backend 'cuda_grap'" in err


def test_a_corrupt_tokenizer_is_named(capsys, demo_dir, tmp_path):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(demo_dir, d)
    (d / "tokenizer.json").write_text('{"model": 3')
    code, _, err = run_cli(capsys, "run", d, "--hw", "cpu", "--prompt", "hi", "--max-new-tokens", 1)
    assert code == 2 and one_line(err) and "tokenizer.json cannot be loaded as a tokenizer" in err


def test_a_plan_past_the_profile_memory_is_an_error_with_the_numbers(demo_dir, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr("ktflow.util.notices._said", set())
    from ktflow.errors import ConfigError
    from ktflow.costmodel.hw import PRESETS

    base = PRESETS["cpu"]
    small = base.model_copy(update={"cpu": base.cpu.model_copy(update={"numa": [
        n.model_copy(update={"memory_bytes": 1e6}) for n in base.cpu.numa]})})
    model = ktflow.load(demo_dir)
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GB of host memory; the profile .* has 0.0 GB.*--allow-oversize"):
        ktflow.compile(model, hw=small, max_seq_len=32)
    ktflow.compile(model, hw=small, max_seq_len=32, allow_oversize=True)
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(demo_dir / "config.json", only / "config.json")
    capsys.readouterr()
    ktflow.compile(ktflow.load(only), hw=small, max_seq_len=32)  # planning for another machine: a warning
    err = capsys.readouterr().err
    assert "warning" in err and "host memory" in err and "for another machine" in err


def test_check_finite_names_the_first_node_that_made_a_nan(demo_dir, capsys, monkeypatch):
    """A NaN made at run time (here an attention output forced to NaN) is named by node with
    --check-finite; without it, the token selection refuses the NaN logits it reaches."""
    from ktflow.backends.torch_ref import TorchRefBackend

    real = TorchRefBackend.run

    def poisoned(self, node, inputs, ctx):
        out = real(self, node, inputs, ctx)
        return out * float("nan") if node.name == "L1.attn" else out

    monkeypatch.setattr(TorchRefBackend, "run", poisoned)
    argv = ["run", demo_dir, "--hw", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--input-ids", "1 2 3",
            "--max-new-tokens", 1]
    code, _, err = run_cli(capsys, *argv, "--check-finite")
    assert code == 1 and one_line(err) and "node L1.attn (attention, prefill step at position 0) produced nan" in err
    monkeypatch.delenv("KTFLOW_CHECK_FINITE", raising=False)
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and one_line(err) and "the prompt's last position" in err and "--check-finite" in err


def test_progress_shows_on_a_terminal_only_and_not_when_quiet(monkeypatch):
    from ktflow.util import progress

    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            pass

        def flush(self):
            pass

    monkeypatch.setattr(progress, "QUIET", False)
    monkeypatch.delenv("KTFLOW_QUIET", raising=False)
    monkeypatch.setattr(progress.sys, "stderr", Tty())
    assert progress.shown() and not progress.bar(range(3), "x", "it").disable
    assert progress.bar(range(3), "x", "it", show=False).disable
    monkeypatch.setenv("KTFLOW_QUIET", "1")
    assert not progress.shown()
    monkeypatch.delenv("KTFLOW_QUIET")
    assert cli.main(["--quiet", "hw", "show"]) == 0 and progress.QUIET
    monkeypatch.setattr(progress, "QUIET", False)
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    assert not progress.shown()  # not a terminal


@pytest.mark.parametrize("argv", [["compile", "x", "--max-seq-len", "1e11"], ["bogus"], [], ["hw", "show", "--bad"]])
def test_usage_errors_are_one_line(argv):
    r = subprocess.run([sys.executable, "-m", "ktflow", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and one_line(r.stderr) and "error:" in r.stderr and "--help" in r.stderr, r.stderr
