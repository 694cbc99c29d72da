"""Checkpoint reading: one file or shards, per-expert or fused expert keys, lazy mmap, and the
errors for missing, mis-shaped, wrong-dtype tensors and corrupt files."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import ktflow
from ktflow.errors import WeightError
from ktflow.frontend.weights import WeightSource


@pytest.fixture()
def ckpt(demo_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(demo_dir, d)
    return d


def _edit(d, fn):
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors")


def test_tensors_are_zero_copy_views_of_the_file(ckpt):
    src = WeightSource(ckpt)
    a, b = src.get("model.norm.weight"), src.get("model.norm.weight")
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapped page: nothing loaded twice
    ref = load_file(ckpt / "model.safetensors")["model.norm.weight"]
    assert torch.equal(a, ref)


def test_sharded_checkpoint_with_index(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    keys = sorted(sd)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, ckpt / name)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    model = ktflow.load(ckpt)
    assert len(model.weights.files) == 2
    assert torch.equal(model.weights.get(keys[-1]), sd[keys[-1]])


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "nope.safetensors"}}))
    with pytest.raises(WeightError, match="nope.safetensors"):
        ktflow.load(ckpt)


def test_extra_tensors_are_ignored(ckpt):
    _edit(ckpt, lambda sd: sd.update({"model.layers.4.eh_proj.weight": torch.zeros(2, 2),
                                      "model.layers.4.mlp.experts.0.up_proj.weight": torch.zeros(3)}))
    ktflow.load(ckpt)


def test_missing_tensor_is_named(ckpt):
    _edit(ckpt, lambda sd: sd.pop("model.layers.2.mlp.experts.5.down_proj.weight"))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight.*\[256, 128\]"):
        ktflow.load(ckpt)


def test_wrong_shape_names_expected_and_found(ckpt):
    _edit(ckpt, lambda sd: sd.update({"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(10, 64,
                                                                                               dtype=torch.bfloat16)}))
    with pytest.raises(WeightError) as e:
        ktflow.load(ckpt)
    msg = str(e.value)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in msg and "[10, 64]" in msg and "[512, 64]" in msg


def test_wrong_dtype_is_an_error(ckpt):
    _edit(ckpt, lambda sd: sd.update({"model.norm.weight": torch.zeros(256, dtype=torch.int32)}))
    with pytest.raises(WeightError, match="model.norm.weight.*I32"):
        ktflow.load(ckpt)


@pytest.mark.parametrize("damage", ["truncated", "huge_header", "not_json", "bad_offsets"])
def test_corrupt_file_is_an_error(ckpt, damage):
    p = ckpt / "model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncated":
        p.write_bytes(raw[:5])
    elif damage == "huge_header":
        p.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    elif damage == "not_json":
        p.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    else:
        header = json.loads(raw[8:8 + n])
        k = next(k for k in header if k != "__metadata__")
        header[k]["data_offsets"][1] += 4
        h = json.dumps(header).encode()
        p.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    with pytest.raises(WeightError, match="corrupt"):
        ktflow.load(ckpt)


def test_config_only_dir_compiles_but_does_not_run(demo_dir, tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(demo_dir / "config.json", d)
    model = ktflow.load(d)
    assert model.weights is None
    compiled = ktflow.compile(model, hw="cpu")
    with pytest.raises(ktflow.KtflowError, match="without weights"):
        ktflow.execute(compiled, torch.tensor([[1, 2]]))


def test_mixed_precision_float_weights_are_accepted(ckpt):
    """A float32 tensor in a bf16 checkpoint (e.g. DeepSeek-V3's correction bias) loads and runs."""
    _edit(ckpt, lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].float()}))
    compiled = ktflow.compile(ktflow.load(ckpt), hw="cpu", max_seq_len=16)
    logits, _ = ktflow.execute(compiled, torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all()


def _rewrite_header(p, change):
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = change(header, raw[8 + n:])
    h = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _first(header):
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


@pytest.mark.parametrize("damage,words", [
    ("offsets_as_strings", "data_offsets"),
    ("shape_with_bool", "shape"),
    ("shape_as_string", "shape"),
    ("dtype_number", "dtype"),
    ("entry_is_list", "not a JSON object"),
    ("overlap", "overlaps"),
    ("gap", "unused"),
    ("appended", "bytes appended"),
    ("metadata_number", "__metadata__"),
])
def test_header_fields_are_checked_by_type_and_tiling(ckpt, damage, words):
    """Every header field has its JSON type (no strings, floats or booleans for integers) and the
    tensors tile the data section exactly."""
    def change(h, data):
        k = _first(h)
        e = h[k]
        if damage == "offsets_as_strings":
            e["data_offsets"] = [str(o) for o in e["data_offsets"]]
        elif damage == "shape_with_bool":
            e["shape"] = [True] + e["shape"][1:]
        elif damage == "shape_as_string":
            e["shape"] = str(e["shape"])
        elif damage == "dtype_number":
            e["dtype"] = 7
        elif damage == "entry_is_list":
            h[k] = [1, 2]
        elif damage == "metadata_number":
            h["__metadata__"] = {"format": 1}
        elif damage in ("overlap", "gap"):  # move the second tensor by one element
            second = sorted((v["data_offsets"][0], n) for n, v in h.items() if n != "__metadata__")[1][1]
            step = -2 if damage == "overlap" else 2
            h[second]["data_offsets"] = [o + step for o in h[second]["data_offsets"]]
            if damage == "gap":
                return data + b"\0\0"
        elif damage == "appended":
            return data + b"\0" * 16
        return data

    _rewrite_header(ckpt / "model.safetensors", change)
    with pytest.raises(WeightError, match=words):
        ktflow.load(ckpt)


@pytest.mark.parametrize("index", [{"weight_map": ["a", "b"]}, {"weight_map": {"x": 3}}, [1, 2],
                                   {"weight_map": {"x": "../model.safetensors"}}, "{not json"])
def test_malformed_index_is_named(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(WeightError, match="index"):
        ktflow.load(ckpt)
