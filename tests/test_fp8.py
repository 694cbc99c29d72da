"""FP8 checkpoints as published (e4m3 weights with block scales, `quantization_config`):
tiny models of three families synthesized in that layout, run by ktflow against HF transformers
on the dequantized weights; and the errors for what ktflow does not read."""

import json
import shutil

import pytest
import torch

import hf_tiny
import ktflow
from ktflow import native
from ktflow.errors import ConfigError, WeightError
from test_hf_parity import assert_close, hf_and_ktflow_logits

CASES = ["deepseek_v3", "qwen3_moe", "glm4_moe"]


@pytest.fixture(scope="module")
def fp8_dirs(tiny_dirs, tmp_path_factory):
    """case -> (FP8 checkpoint dir, HF model holding the dequantized weights)."""
    made = {}

    def get(case, block=(16, 32)):
        if (case, block) not in made:
            _, hf = tiny_dirs(case)
            d = tmp_path_factory.mktemp(f"{case}-fp8")
            meant = hf_tiny.to_fp8(hf, d, block)
            import copy

            ref = copy.deepcopy(hf)
            ref.load_state_dict(meant)
            made[(case, block)] = (d, ref)
        return made[(case, block)]

    return get


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_fp8_checkpoint_matches_hf_on_the_dequantized_weights(case, block, fp8_dirs):
    """float32 torch_ref on the FP8 dir against transformers on the same weights dequantized:
    the dequantization is exact, so the parity bound is the float32 one (1e-4); blocks of 16 x 32
    cut every matrix of the tiny models into several blocks with partial edge blocks."""
    d, ref = fp8_dirs(case, block)
    model = ktflow.load(d)
    assert model.weights.quant is not None and model.weights.quant.block == block
    compiled = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32")
    assert_close(*hf_and_ktflow_logits(ref, compiled, model.config.vocab_size))


@pytest.mark.skipif(not native.available(), reason="native module not built")
@pytest.mark.parametrize("fmt", ["auto", "bf16", "int8"])
def test_fp8_checkpoint_packs_native_experts(fmt, fp8_dirs):
    """Routed experts packed from the FP8 tensors run on the native kernels within the bf16 / int8
    tolerance of torch_ref on the same checkpoint: auto keeps them fp8 (the checkpoint's bytes and
    32-column block scales copied as they are), bf16 / int8 re-quantize them while packing."""
    from test_native_backend import TOL, logits

    d, _ = fp8_dirs("deepseek_v3")
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    ref = ktflow.compile(model, hw="cpu", max_seq_len=32, dtype="float32")
    nat = ktflow.compile(model, hw="cpu", max_seq_len=32, dtype="bfloat16", backend="native", expert_format=fmt)
    want, fed = logits(ref, ids)
    got, _ = logits(nat, ids, decode_tokens=fed)
    err = ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).median()
    assert nat.plans.options.expert_format == ("fp8" if fmt == "auto" else fmt)
    assert err < TOL["bf16" if fmt == "auto" else fmt], err  # fp8: the same weights, bf16 activations


def _edit(src, dst, config=None, drop=(), retype=None):
    """A copy of checkpoint `src` with config.json edited and tensors removed or re-typed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(dst / "model.safetensors"))
    for k in drop:
        del t[k]
    for k, v in (retype or {}).items():
        t[k] = v(t[k])
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors", "mxfp4", None])
def test_a_quantization_method_ktflow_does_not_read_is_named(method, fp8_dirs, tmp_path):
    d, _ = fp8_dirs("qwen3_moe")
    bad = _edit(d, tmp_path / "q", config=lambda c: c["quantization_config"].update(quant_method=method))
    with pytest.raises(ConfigError, match=f"quant_method {method!r} is not read by ktflow.*fp8"):
        ktflow.load(bad)


def test_fp8_weight_errors_name_the_tensor(fp8_dirs, tmp_path):
    d, _ = fp8_dirs("qwen3_moe")
    key = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "no-scale": (dict(drop=[key + "_scale_inv"]), f"FP8 tensor '{key}' has no '{key}_scale_inv'"),
        "scale-shape": (dict(retype={key + "_scale_inv": lambda s: s[:, :1].contiguous()}),
                        f"'{key}_scale_inv' has shape .* expected"),
        "scale-dtype": (dict(retype={key + "_scale_inv": lambda s: s.to(torch.int32)}),
                        f"'{key}_scale_inv' has dtype I32"),
        "undeclared": (dict(config=lambda c: c.pop("quantization_config")),
                       "is F8_E4M3 but config.json has no quantization_config"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(WeightError, match=message):
            ktflow.load(_edit(d, tmp_path / name, **edit))


@pytest.mark.parametrize("qc", [{"quant_method": "fp8", "weight_block_size": [128]},
                                {"quant_method": "fp8", "weight_block_size": [128, 0]},
                                {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
                                {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                                "fp8"])
def test_bad_quantization_configs_are_refused(qc, fp8_dirs, tmp_path):
    d, _ = fp8_dirs("qwen3_moe")
    bad = _edit(d, tmp_path / "q", config=lambda c: c.update(quantization_config=qc))
    with pytest.raises(ConfigError, match="quantization_config"):
        ktflow.load(bad)


def test_the_cli_says_one_line_for_an_unread_quantization(fp8_dirs, tmp_path, capsys):
    from ktflow import cli

    d, _ = fp8_dirs("qwen3_moe")
    bad = _edit(d, tmp_path / "q", config=lambda c: c["quantization_config"].update(quant_method="awq"))
    code = cli.main(["compile", str(bad), "--hw", "cpu", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and "quant_method 'awq'" in err and "Traceback" not in err


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((100, 200), (16, 32)), ((7, 5), (128, 128))])
def test_dequantize_applies_each_blocks_scale(shape, block):
    """Whole blocks (the broadcast path) and partial edge blocks against an element loop's rule."""
    from ktflow.quant import dequantize

    g = torch.Generator().manual_seed(0)
    w8 = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g) + 0.5
    got = dequantize(w8, s, block)
    rows = torch.arange(shape[0])[:, None] // block[0]
    cols = torch.arange(shape[1])[None, :] // block[1]
    assert torch.equal(got, w8.float() * s[rows, cols])


def test_fp8_numa_slices_start_on_checkpoint_blocks():
    """tp slices of fp8 experts are whole 128-row groups (their down columns keep the checkpoint's
    blocks); other formats keep numa_block."""
    from conftest import DATA

    model = ktflow.load(DATA / "deepseek-v3-config")
    for fmt, block in (("fp8", 128), ("bf16", 64)):
        c = ktflow.compile(model, hw="cpu", numa_nodes=3, numa="tp", expert_format=fmt, allow_oversize=True)
        rows = {n.attrs.rows for n in c.decode.ir.nodes if n.op.value == "routed_experts"}
        assert len(rows) == 3 and all(lo % block == 0 for lo, _ in rows), (fmt, rows)
        assert any(lo % 128 for lo, _ in rows) == (fmt == "bf16"), (fmt, rows)
