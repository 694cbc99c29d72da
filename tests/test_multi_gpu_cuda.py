"""Several CUDA ranks (one process a GPU, NCCL inside the captured decode steps): two ranks give
one rank's greedy tokens. Skipped where torch sees fewer than two GPUs."""

import json

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.costmodel.hw import PRESETS
from ktflow.runtime.ranks import run_ranks
from test_multi_gpu import HW, _budget

two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and native.available()), reason="needs two CUDA GPUs and the native module")


def _profile_here(path) -> str:
    """HW's speeds with every GPU's memory this host's (a plan is placed for the card it runs on)."""
    here = float(torch.cuda.get_device_properties(0).total_memory)
    p = PRESETS[HW]
    p = p.model_copy(update={"gpus": [g.model_copy(update={"memory_bytes": here}) for g in p.gpus]})
    path.write_text(p.model_dump_json())
    return str(path)


def _options(case_dir, hw: str) -> dict:
    return dict(hw=hw, device="cuda", max_seq_len=128, dtype="float32", vram_budget_gb=_budget(case_dir),
                allow_oversize=True)


def _greedy(rank: int, path: str, case_dir: str, options: dict, prompt: list[int], new: int) -> None:
    """One CUDA rank: its plans (checked against the other's), greedy decode through the CUDA-graph
    backend; rank 0 writes the ids and how many experts each rank held on its GPU."""
    from ktflow.ir.ops import Op
    from ktflow.runtime.ranks import check_plans_agree

    assert torch.cuda.current_device() == rank
    c = ktflow.compile(ktflow.load(case_dir), rank=rank, **options)
    check_plans_agree(c.plans.plans)
    out = ktflow.generate(c, torch.tensor([prompt]), new)
    held = sum(len(n.attrs.ids) for n in c.decode.ir.nodes
               if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu")
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"ids": out[0].tolist(), "held": held, "backend": c.plans.options.backend}, f)


@two_gpus
@pytest.mark.parametrize("case", ["demo", "deepseek_v2_lite", "qwen3_moe", "mixtral"])
def test_two_cuda_ranks_give_one_ranks_greedy_tokens(case, demo_dir, tiny_dirs, tmp_path):
    d = demo_dir if case == "demo" else tiny_dirs(case)[0]
    options = _options(d, _profile_here(tmp_path / "hw.json"))
    prompt, new = [1, 5, 9, 33, 7, 2], 12
    one = ktflow.generate(ktflow.compile(ktflow.load(d), **options), torch.tensor([prompt]), new)[0].tolist()
    torch.cuda.synchronize()
    path = tmp_path / "out"
    run_ranks(2, _greedy, str(path), str(d), dict(options, gpus=2), prompt, new, cuda=True)
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert ranks[0]["ids"] == one and ranks[1]["ids"] == one
    assert ranks[0]["held"] > 0 and ranks[1]["held"] > 0, "both GPUs hold experts (the test's premise)"


@two_gpus
def test_run_with_two_cuda_ranks_prints_one_ranks_tokens(demo_dir, tmp_path, capfd):
    from ktflow.tools.cli import main

    args = [str(demo_dir), "--hw", _profile_here(tmp_path / "hw.json"), "--device", "cuda", "--dtype", "float32",
            "--max-seq-len", "128", "--vram-budget-gb", f"{_budget(demo_dir):.6f}", "--allow-oversize",
            "--max-new-tokens", "6", "--input-ids", "1,5,9,33"]
    assert main(["run", *args]) == 0
    one = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids")]
    assert main(["run", *args, "--gpus", "2"]) == 0
    two = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids")]
    assert one and two == one


def test_cuda_ranks_need_as_many_gpus(demo_dir):
    from ktflow.errors import KtflowError

    have = torch.cuda.device_count()
    n = max(2, have + 1)
    with pytest.raises(KtflowError, match=f"{n} CUDA ranks need {n} GPUs; torch sees {have} on this host"):
        run_ranks(n, _greedy, cuda=True)
