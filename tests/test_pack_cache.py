"""The packed-expert cache heals: a damaged file (truncated, bytes changed, not safetensors) is
removed and the experts packed again with one warning; a cache dir that cannot be written is given
up with one warning and the run goes on; a NaN or infinity in an expert's source is a WeightError
naming the expert, the matrix and the index, in every format."""

import os

import pytest
import torch

from ktflow.backends.native import binding as native
from ktflow.errors import WeightError

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native module")
E, H, I = 4, 64, 32


def experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*s, generator=g).bfloat16() for s in ((I, H), (I, H), (H, I))) for _ in range(E)]


def packed(cache, fmt="bf16", weights=None):
    w = weights or experts()
    op = native.ExpertOp(E, H, I, fmt=fmt)
    return op, op.pack(lambda e: w[e], cache=cache, fingerprint="fp")


def out_of(op):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    return op.forward(x, ids, torch.full((5, 2), 0.5))


@pytest.fixture(autouse=True)
def writable_again(monkeypatch):
    monkeypatch.setattr(native, "_CACHE_UNWRITABLE", False)
    monkeypatch.setattr("ktflow.util.notices._said", set())


@pytest.mark.parametrize("damage", ["truncate", "flip_middle", "garbage", "empty"])
def test_a_damaged_cache_file_is_repacked_with_one_warning(tmp_path, capsys, damage):
    ref, how = packed(tmp_path)
    assert how == "packed"
    (f,) = tmp_path.glob("*.safetensors")
    raw = bytearray(f.read_bytes())
    if damage == "truncate":
        raw = raw[:len(raw) * 2 // 3]
    elif damage == "flip_middle":  # inside the data section, where the sampled digest looks
        raw[-len(raw) // 2 - 9] ^= 0xFF
    elif damage == "garbage":
        raw = bytearray(b"\x07" * 100)
    else:
        raw = bytearray()
    f.write_bytes(bytes(raw))
    capsys.readouterr()
    op, how = packed(tmp_path)
    err = capsys.readouterr().err
    assert how == "packed" and err.count("warning") == 1 and str(f) in err and "unusable" in err
    assert torch.equal(out_of(op), out_of(ref))
    again, how = packed(tmp_path)  # rewritten whole
    assert how == "cache" and torch.equal(out_of(again), out_of(ref))
    assert capsys.readouterr().err == ""


def test_a_cache_dir_that_cannot_be_written_is_given_up_with_one_warning(tmp_path, capsys):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")  # a cache "dir" below a regular file: every write fails
    ops = [packed(blocked / "cache") for _ in range(3)]
    err = capsys.readouterr().err
    assert [how for _, how in ops] == ["packed"] * 3
    assert err.count("warning") == 1 and "going on without it" in err and "KTFLOW_CACHE_DIR" in err
    assert torch.equal(out_of(ops[0][0]), out_of(ops[2][0]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only dirs")
def test_a_read_only_cache_dir(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _, how = packed(ro)
    finally:
        ro.chmod(0o700)
    assert how == "packed" and "cannot write the packed-expert cache" in capsys.readouterr().err
    assert not list(ro.iterdir())  # nothing half-written


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_expert_weight_is_named(tmp_path, fmt, bad):
    w = experts()
    gate, up, down = (t.clone() for t in w[2])
    up[3, 5] = bad
    w[2] = (gate, up, down)
    with pytest.raises(WeightError, match=r"expert 2 up: non-finite value at \[3, 5\]"):
        packed(None, fmt=fmt, weights=w)
    down = w[1][2].clone()
    down[60, 31] = bad  # the last column of the last slice
    w = experts()
    w[1] = (w[1][0], w[1][1], down)
    with pytest.raises(WeightError, match=r"expert 1 down: non-finite value at \[60, 31\]"):
        packed(tmp_path, fmt=fmt, weights=w)
    assert not list(tmp_path.glob("*.safetensors"))  # nothing cached from a bad checkpoint


def test_a_checkpoint_swapped_under_the_same_name_size_and_mtime_is_packed_again(tmp_path, monkeypatch):
    """The cache's key is the files' identity (inode, ctime, header), not their names: another
    checkpoint moved into place with the same file name, size and modification time never runs
    with the first one's packed experts."""
    import shutil

    import hf_tiny
    import ktflow

    pytest.importorskip("transformers")
    monkeypatch.setenv("KTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    hf_tiny.make("qwen3_moe", a, seed=0)
    hf_tiny.make("qwen3_moe", b, seed=1)
    ids = torch.tensor([[1, 5, 9, 33]])
    opts = dict(hw="cpu", device="cpu", placement="cpu", max_seq_len=32, dtype="bfloat16", backend="native")
    logits = lambda d: ktflow.execute(ktflow.compile(ktflow.load(d), **opts), ids)[0]  # noqa: E731
    first = logits(a)
    assert list((tmp_path / "cache").glob("*.safetensors")), "the first load packed into the cache"
    (f,) = [p.name for p in a.glob("*.safetensors")]
    st = os.stat(a / f)
    assert os.stat(b / f).st_size == st.st_size
    shutil.copyfile(b / f, a / (f + ".new"))
    os.replace(a / (f + ".new"), a / f)
    os.utime(a / f, ns=(st.st_atime_ns, st.st_mtime_ns))
    swapped = logits(a)
    assert torch.equal(swapped, logits(b)) and not torch.equal(swapped, first)
