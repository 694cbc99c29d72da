"""Several CUDA ranks (one process a GPU, NCCL inside the captured decode steps): two ranks give
one rank's logits. Skipped where torch sees fewer than two GPUs."""

import json

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.runtime.ranks import run_ranks
from test_multi_gpu import PLACE_HW, SHARE, _budget

two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and native.available()), reason="needs two CUDA GPUs and the native module")


def _profile_here(path) -> str:
    """PLACE_HW's speeds with every GPU's memory this host's (a plan is placed for the card it runs on)."""
    here = float(torch.cuda.get_device_properties(0).total_memory)
    p = PLACE_HW
    p = p.model_copy(update={"gpus": [g.model_copy(update={"memory_bytes": here}) for g in p.gpus]})
    path.write_text(p.model_dump_json())
    return str(path)


def _options(case_dir, hw: str, share: float = 0.45) -> dict:
    plan = dict(dtype="bfloat16", prefill_reserve="none")
    return dict(hw=hw, device="cuda", backend="cuda_graph", max_seq_len=128, allow_oversize=True,
                vram_budget_gb=_budget(case_dir, hw=PLACE_HW, share=share, **plan), **plan)


PROMPT, STEPS = [1, 5, 9, 33, 7, 2], 6


def _forced_logits(c) -> list[torch.Tensor]:
    """The prompt's last logits, then STEPS decode steps fed fixed random ids: each step's logits."""
    from test_cuda_graph import run_steps

    return [x[:, -1].float().cpu() for x in run_steps(c, torch.tensor([PROMPT]), STEPS)]


def _rank_logits(rank: int, path: str, case_dir: str, options: dict, capture: bool = True) -> None:
    """One CUDA rank: its plans (checked against the other's), the forced steps through the
    CUDA-graph backend; each rank writes its logits, whether its decode step ran as a captured
    graph, and how many experts its GPU held."""
    from safetensors.torch import save_file

    from ktflow.ir.ops import Op
    from ktflow.runtime.ranks import check_plans_agree

    assert torch.cuda.current_device() == rank
    c = ktflow.compile(ktflow.load(case_dir), rank=rank, **options)
    check_plans_agree(c.plans.plans)
    c.executor("decode").runner.capture = capture
    got = _forced_logits(c)
    held = sum(len(n.attrs.ids) for n in c.decode.ir.nodes
               if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu")
    captured = c.executor("decode").runner.bound[1].graph is not None
    save_file({f"step{i}": x.contiguous() for i, x in enumerate(got)}, f"{path}.{rank}",
              metadata={"held": str(held), "captured": str(captured)})


@two_gpus
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("case", ["demo", "deepseek_v2_lite", "qwen3_moe", "mixtral"])
def test_two_cuda_ranks_give_one_ranks_logits(case, capture, demo_dir, tiny_dirs, tmp_path):
    """Each decode step issued eagerly, or as a captured graph holding every layer's NCCL
    all-reduce; both ranks' logits equal one rank's within bf16 rounding (the parts are summed in
    another order). One rank under two placements (the test's budget, every expert on the CPU)
    is the reference: where a router's top-k is a near tie, bf16 rounding alone picks another
    expert in one of them (tiny Mixtral's fifth step does, rel 0.12 between the two), so each
    step must match at least one of the two."""
    from safetensors import safe_open

    from test_cuda_graph import rel

    d = demo_dir if case == "demo" else tiny_dirs(case)[0]
    options = _options(d, _profile_here(tmp_path / "hw.json"), SHARE.get(case, 0.45))
    one = _forced_logits(ktflow.compile(ktflow.load(d), **options))
    on_cpu = _forced_logits(ktflow.compile(ktflow.load(d), **dict(options, placement="cpu")))
    torch.cuda.synchronize()
    run_ranks(2, _rank_logits, str(tmp_path / "out"), str(d), dict(options, gpus=2), capture, cuda=True)
    for r in range(2):
        with safe_open(str(tmp_path / f"out.{r}"), "pt") as f:
            meta = f.metadata()
            assert int(meta["held"]) > 0, f"rank {r}'s GPU holds experts (the test's premise)"
            assert meta["captured"] == str(capture), f"rank {r}'s decode step ran as asked (captured: {capture})"
            for i, (want, alt) in enumerate(zip(one, on_cpu)):
                got = f.get_tensor(f"step{i}")
                assert min(rel(got, want), rel(got, alt)) < 0.02, (r, i, rel(got, want), rel(got, alt))


@two_gpus
def test_run_with_two_cuda_ranks_prints_rank_0s_tokens_once(demo_dir, tmp_path, capfd):
    from ktflow.tools.cli import main

    args = [str(demo_dir), "--hw", _profile_here(tmp_path / "hw.json"), "--device", "cuda", "--max-seq-len", "128",
            "--vram-budget-gb", f"{_budget(demo_dir, hw=PLACE_HW, dtype='bfloat16'):.6f}", "--allow-oversize", "--max-new-tokens", "6",
            "--input-ids", "1,5,9,33", "--ignore-eos", "--gpus", "2"]
    assert main(["run", *args]) == 0
    printed = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids")]
    assert len(printed) == 1, printed  # rank 0 alone prints
    assert len(json.loads(printed[0][len("generated ids "):])) == 6, printed


def test_cuda_ranks_need_as_many_gpus(demo_dir):
    from ktflow.errors import KtflowError

    have = torch.cuda.device_count()
    n = max(2, have + 1)
    with pytest.raises(KtflowError, match=f"{n} CUDA ranks need {n} GPUs; torch sees {have} on this host"):
        run_ranks(n, _rank_logits, cuda=True)
