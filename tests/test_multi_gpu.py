"""Plans over several GPU ranks: expert-parallel placement, the all-reduce each MoE layer ends in,
and the ranks run as processes over gloo (the correctness mode: GPU work on the CPU)."""

import json

import pytest
import torch

import ktflow
from ktflow.costmodel.collectives import collective_seconds
from ktflow.costmodel.hw import PRESETS, Overheads
from ktflow.errors import ConfigError, KtflowError
from ktflow.ir.ops import Op, collective_signature
from ktflow.ir.verify import violations
from ktflow.runtime.ranks import plans_digest, run_ranks

HW = "h100-x2"


#: HW without fixed overheads: placement by intensity alone, so even the tiny models' experts reach the GPUs
PLACE_HW = PRESETS[HW].model_copy(update={"overheads": Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0,
                                                                 cpu_sync_us=0)})


def _budget(case_dir, hw=HW, share: float = 0.45, **options) -> float:
    """A per-GPU residency budget (GB): `share` of the whole model's, under which two ranks hold some
    of the experts and the CPU the rest (where `hw`'s cost model puts experts on a GPU at all), for
    plans with `options` (such as their dtype)."""
    full = ktflow.compile(ktflow.load(case_dir), hw=hw, device="cpu", max_seq_len=128, placement="gpu",
                          allow_oversize=True, vram_budget_gb=1000, **options)
    m = full.decode.memory
    return (m.weight_bytes + m.kv_cache_bytes) / 1e9 * share


def held(plan) -> tuple[int, int]:
    """(routed experts on the plan's GPU, on its CPU)."""
    return (sum(len(v) for v in experts_of(plan, "gpu").values()),
            sum(len(v) for v in experts_of(plan, "cpu").values()))


def small(model) -> dict:
    return dict(vram_budget_gb=_budget(model.path), allow_oversize=True, device="cpu", max_seq_len=128)


def ranked(model, gpus=2, **kw):
    return [ktflow.compile(model, hw=HW, gpus=gpus, rank=r, **{**small(model), **kw}) for r in range(gpus)]


def experts_of(plan, device=None):
    """layer -> expert ids of the plan's routed-experts parts (on `device` where given)."""
    out: dict[int, list[int]] = {}
    for n in plan.ir.nodes:
        if n.op == Op.ROUTED_EXPERTS and (device is None or n.place.device.value == device):
            out.setdefault(n.attrs.layer, []).extend(n.attrs.ids)
    return out


def test_the_ranks_divide_the_gpu_experts_and_rank_0_drives_the_cpu_ones(demo_dir):
    model = ktflow.load(demo_dir)
    r0, r1 = (c.decode for c in ranked(model))
    layers = sorted({n.attrs.layer for p in (r0, r1) for n in p.ir.nodes if n.op == Op.COLLECTIVE})
    assert layers, "every MoE layer ends in an all-reduce"
    experts = model.config.num_routed_experts if hasattr(model.config, "num_routed_experts") else None
    some_cpu = False
    for layer in layers:
        g0, g1 = experts_of(r0, "gpu").get(layer, []), experts_of(r1, "gpu").get(layer, [])
        cpu = experts_of(r0, "cpu").get(layer, [])
        some_cpu |= bool(cpu)
        every = sorted(g0 + g1 + cpu)
        assert every == list(range(len(every))), f"layer {layer}: each expert computed once over the ranks"
        if experts:
            assert len(every) == experts
    assert some_cpu, "at this VRAM some experts stay on the CPU (the test's premise)"
    assert not experts_of(r1, "cpu"), "rank 1 drives no CPU experts"
    for c, r in zip(ranked(model), (r0, r1)):  # the plan's summary says the rank's share and its all-reduces
        held = sum(len(v) for v in experts_of(r, "gpu").values())
        cpu = sum(len(v) for v in experts_of(r, "cpu").values())
        lines = c.plans.summary().splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("decode"))
        line = next(ln for ln in lines[at:] if "ranks:" in ln)
        assert (f"rank {c.plans.options.rank} of 2: {held} routed experts on its GPU, {cpu} on the CPU" in line
                and f" {len(layers)} all-reduces" in line), line
    assert collective_signature(r0.ir) == collective_signature(r1.ir)
    # dense work replicated: the same non-expert nodes on the same devices
    dense = lambda p: [(n.name, n.place.device) for n in p.ir.nodes if n.op in (Op.ATTENTION, Op.LM_HEAD)]  # noqa: E731
    assert dense(r0) == dense(r1)


def test_every_ranks_plans_list_the_same_collectives(demo_dir):
    model = ktflow.load(demo_dir)
    plans = [c.plans.plans for c in ranked(model)]
    assert [p.phase for p in plans[0]] == [p.phase for p in plans[1]]
    assert plans_digest(plans[0]) == plans_digest(plans[1])
    one = ktflow.compile(model, hw=HW, **small(model)).plans.plans
    assert plans_digest(one) != plans_digest(plans[0])


def test_two_gpus_hold_about_twice_the_experts_and_the_plan_prices_the_all_reduce(demo_dir):
    model = ktflow.load(demo_dir)
    one = ktflow.compile(model, hw=HW, **small(model)).decode
    two = ranked(model)
    held_one = sum(len(v) for v in experts_of(one, "gpu").values())
    held_two = sum(len(v) for c in two for v in experts_of(c.decode, "gpu").values())
    assert held_one > 0 and held_two >= 1.8 * held_one
    hw = PRESETS[HW]
    for n in two[0].decode.ir.nodes:
        if n.op == Op.COLLECTIVE:
            nbytes = n.out.numel(1) * 4  # the parts are summed in float32
            assert n.cost.gpu_s == pytest.approx(collective_seconds("all_reduce", nbytes, 2, hw))
            assert n.place.lane == "gpu" and "expert parallel over 2 GPUs" in n.place.cause


def test_bad_rank_options_name_the_problem(demo_dir):
    model = ktflow.load(demo_dir)
    with pytest.raises(ConfigError, match="gpus=4 but hardware profile 'h100-x2' has 2 GPU"):
        ktflow.compile(model, hw=HW, gpus=4, **small(model))
    with pytest.raises(ConfigError, match="rank=2 is not one of the 2 ranks"):
        ktflow.compile(model, hw=HW, gpus=2, rank=2, **small(model))
    with pytest.raises(ConfigError, match="does not take defer"):
        ktflow.compile(model, hw=HW, gpus=2, defer=1, **small(model))
    with pytest.raises(ConfigError, match="placement='cpu' would put every node on every rank"):
        ktflow.compile(model, hw=HW, gpus=2, placement="cpu", **small(model))


def test_a_plan_for_two_ranks_in_one_process_says_how_to_run_it(demo_dir):
    c = ranked(ktflow.load(demo_dir))[0]
    with pytest.raises(KtflowError, match="spreads over 2 GPU ranks and this process has no process group"):
        ktflow.generate(c, torch.tensor([[1, 2, 3]]), 2)


def test_the_verifier_refuses_an_add_that_reads_a_spread_layers_part(demo_dir):
    from dataclasses import replace

    g = ranked(ktflow.load(demo_dir))[0].decode.ir
    res = next(n for n in g.nodes if n.op == Op.ADD and n.attrs.residual == "ffn"
               and any(g.by_name(i).op == Op.COLLECTIVE for i in n.inputs))
    coll = next(g.by_name(i) for i in res.inputs if g.by_name(i).op == Op.COLLECTIVE)
    part = coll.inputs[-1]
    bad = g.replace_nodes(replace(n, inputs=n.inputs + (part,)) if n.name == res.name else n for n in g.nodes)
    assert any(rule == "R1" and "add the all-reduce" in msg for rule, _, msg in violations(bad, "spec"))
    one_rank = g.replace_nodes(replace(n, attrs=replace(n.attrs, ranks=1)) if n.name == coll.name else n
                               for n in g.nodes)
    assert any(rule == "R1" and "needs 2 or more" in msg for rule, _, msg in violations(one_rank, "spec"))


# ------------------------------------------------------------------------- ranks as processes


#: the residency share at which a case's two ranks hold some experts on each GPU and leave some to the CPU
SHARE = {"deepseek_v2_lite": 0.6}


def _greedy_tokens(rank: int, path: str, case_dir: str, options: dict, prompt: list[int], new: int) -> None:
    """One rank: compile its plans, check them against the others', greedy-decode; each rank writes
    its ids, the experts its decode plan holds on its GPU and CPU, and its native pool's size."""
    from ktflow.backends.native import binding as native
    from ktflow.runtime.ranks import check_plans_agree

    c = ktflow.compile(ktflow.load(case_dir), rank=rank, **options)
    check_plans_agree(c.plans.plans)
    out = ktflow.generate(c, torch.tensor([prompt]), new)
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"ids": out[0].tolist(), "held": held(c.decode), "threads": native.pool().threads}, f)


@pytest.mark.parametrize("case", ["demo", "deepseek_v3", "deepseek_v2_lite", "qwen2_moe", "qwen3_moe", "glm4_moe",
                                  "mixtral"])
def test_two_ranks_over_gloo_give_one_ranks_greedy_tokens(case, demo_dir, tiny_dirs, tmp_path):
    """Each rank's GPU holds some of the experts and rank 0's CPU the rest; both ranks' tokens equal one rank's."""
    d = demo_dir if case == "demo" else tiny_dirs(case)[0]
    options = dict(hw=PLACE_HW, device="cpu", max_seq_len=128, dtype="float32", allow_oversize=True,
                   vram_budget_gb=_budget(d, hw=PLACE_HW, share=SHARE.get(case, 0.45), dtype="float32"))
    prompt, new = [1, 5, 9, 33, 7, 2], 10
    one = ktflow.generate(ktflow.compile(ktflow.load(d), **options), torch.tensor([prompt]), new)[0].tolist()
    path = tmp_path / "out"
    run_ranks(2, _greedy_tokens, str(path), str(d), dict(options, gpus=2), prompt, new)
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert [r["ids"] for r in ranks] == [one, one]
    (gpu0, cpu0), (gpu1, cpu1) = (r["held"] for r in ranks)
    assert gpu0 > 0 and gpu1 > 0 and cpu0 > 0 and cpu1 == 0, "the premise: experts on both GPUs and rank 0's CPU"
    assert ranks[1]["threads"] == 1, "rank 1 drives no CPU experts: one worker, the cores left to rank 0's"


def _compile_own_budget(rank: int, case_dir: str, options: dict) -> None:
    """One rank compiled with its own VRAM budget: the ranks divide the experts differently."""
    from ktflow.runtime.ranks import check_plans_agree

    c = ktflow.compile(ktflow.load(case_dir), hw=HW, rank=rank, **dict(options, vram_budget_gb=options["vram_budget_gb"]
                                                                        * (1 + rank)))
    check_plans_agree(c.plans.plans)


def test_ranks_that_divide_the_experts_differently_fail_at_the_start(demo_dir):
    options = dict(small(ktflow.load(demo_dir)), gpus=2)
    with pytest.raises(KtflowError, match=r"divide the experts wrongly: .* expert \d+ of layer \d+ is computed [02] "
                                          r"times over the ranks, not once"):
        run_ranks(2, _compile_own_budget, str(demo_dir), options)


def _fails_on_rank_1(rank: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 broke")
    dist.barrier()  # rank 0 would wait here forever without the parent stopping it


def test_a_rank_that_fails_stops_the_others_and_is_named():
    with pytest.raises(KtflowError, match=r"rank 1 of 2 failed: ValueError: rank 1 broke \(the other ranks were stopped\)"):
        run_ranks(2, _fails_on_rank_1)


def test_run_with_two_gpus_on_the_cpu_prints_one_ranks_tokens(demo_dir, capfd):
    from ktflow.tools.cli import main

    args = [str(demo_dir), "--hw", HW, "--device", "cpu", "--dtype", "float32", "--max-seq-len", "128",
            "--vram-budget-gb", f"{_budget(demo_dir):.6f}", "--allow-oversize", "--max-new-tokens", "6",
            "--input-ids", "1,5,9,33"]
    assert main(["run", *args]) == 0
    one = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids")]
    assert main(["run", *args, "--gpus", "2"]) == 0
    two = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids")]
    assert one and two == one  # rank 0 alone prints


def test_two_simulated_nodes_under_torchrun_give_one_ranks_tokens(demo_dir, tmp_path):
    """`torchrun --nnodes 2` on this host, one rank a node: each joins from the environment."""
    import os
    import subprocess
    import sys

    from ktflow.runtime.ranks import _free_port

    args = ["-m", "ktflow", "run", str(demo_dir), "--hw", HW, "--device", "cpu", "--dtype", "float32",
            "--max-seq-len", "128", "--vram-budget-gb", f"{_budget(demo_dir):.6f}", "--allow-oversize",
            "--max-new-tokens", "6", "--input-ids", "1,5,9,33"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port,
                               *args, "--gpus", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    ids = lambda text: [ln for ln in text.splitlines() if ln.startswith("generated ids")]  # noqa: E731
    assert ids(outs[0][0]) == ids(one.stdout) and ids(one.stdout) and not ids(outs[1][0])


def test_serve_with_two_ranks_answers_as_one_rank_and_stops_on_sigterm(demo_dir, tmp_path):
    """`serve --gpus 2` over gloo: one HTTP front on rank 0, rank 1 following its steps; greedy and
    seeded sampled completions, two at once, equal one rank's server's; SIGTERM stops both ranks
    and the launcher exits 0."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from concurrent.futures import ThreadPoolExecutor

    from ktflow.serve.demo_tokenizer import write_demo_tokenizer
    from test_serve import served_base

    d = tmp_path / "demo"
    shutil.copytree(demo_dir, d)
    write_demo_tokenizer(d)
    base_args = ["serve", str(d), "--hw", HW, "--device", "cpu", "--dtype", "float32", "--max-seq-len", "128",
                 "--vram-budget-gb", f"{_budget(demo_dir):.6f}", "--allow-oversize", "--port", "0",
                 "--model-name", "demo", "--max-batch", "2"]
    requests = [dict(prompt="the ranks", max_tokens=8, temperature=0), dict(prompt="step together", max_tokens=8,
                                                                             temperature=0.8, top_p=0.9, seed=5)]

    def served(extra: list[str]) -> tuple[list[str], int, str]:
        p = subprocess.Popen([sys.executable, "-m", "ktflow", *base_args, *extra], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "KTFLOW_QUIET": "1"})
        try:
            base = served_base(p)
            post = lambda body: httpx.post(base + "/v1/completions", json=dict(model="demo", **body),  # noqa: E731
                                           timeout=120).json()["choices"][0]["text"]
            with ThreadPoolExecutor(2) as pool:  # at once: one batched decode step for both
                texts = list(pool.map(post, requests))
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=120)
            return texts, p.returncode, out + err
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()

    one, code1, _ = served([])
    two, code2, log = served(["--gpus", "2"])
    assert code1 == 0 and code2 == 0, log[-3000:]
    assert two == one and all(one)
    assert "stopped" in log


def _compile_and_check(rank: int, case_dir: str, options: dict, odd: dict) -> None:
    from ktflow.runtime.ranks import check_plans_agree

    c = ktflow.compile(ktflow.load(case_dir), hw=HW, rank=rank, **{**options, **(odd if rank == 1 else {})})
    check_plans_agree(c.plans.plans)


def test_ranks_whose_plans_disagree_fail_at_the_start_and_name_the_rank(demo_dir):
    """Rank 1 compiled with another max_seq_len (other prefill buckets): every rank refuses before
    a step runs, and the error names rank 1."""
    options = dict(small(ktflow.load(demo_dir)), gpus=2)
    with pytest.raises(KtflowError, match=r"the ranks' plans disagree: rank\(s\) \[1\]"):
        run_ranks(2, _compile_and_check, str(demo_dir), options, dict(max_seq_len=512))


def _sampled_tokens(rank: int, path: str, case_dir: str, options: dict) -> None:
    from ktflow.runtime.ranks import all_ready, common_seed

    c = ktflow.compile(ktflow.load(case_dir), hw=HW, rank=rank, **options)
    c.prepare()
    all_ready()
    out = ktflow.generate(c, torch.tensor([[1, 5, 9]]), 8, temperature=0.9, top_p=0.95, seed=common_seed(None))
    with open(f"{path}.{rank}", "w") as f:
        json.dump(out[0].tolist(), f)


def test_sampled_decoding_over_ranks_takes_one_seed_for_all(demo_dir, tmp_path):
    """Sampling with no seed given: the ranks share rank 0's random seed, so every rank selects the
    same tokens (a rank feeding other tokens would sum other experts' outputs); generate refuses an
    unseeded sampled run of a plan over several ranks."""
    options = dict(small(ktflow.load(demo_dir)), gpus=2, dtype="float32")
    path = str(tmp_path / "ids")
    run_ranks(2, _sampled_tokens, path, str(demo_dir), options)
    assert json.loads(open(path + ".0").read()) == json.loads(open(path + ".1").read())
    c = ktflow.compile(ktflow.load(demo_dir), hw=HW, **options)
    with pytest.raises(ktflow.errors.InputError, match="only with a seed"):
        ktflow.generate(c, torch.tensor([[1, 2]]), 2, temperature=0.7)


def test_every_rank_keeps_the_same_prefill_buckets(demo_dir):
    """At a max_seq_len of several buckets the ranks' plans list the same steps (a rank without CPU
    experts would otherwise merge buckets rank 0 keeps apart)."""
    model = ktflow.load(demo_dir)
    plans = [c.plans.plans for c in ranked(model, max_seq_len=1024)]
    assert len(plans[0]) > 2 and [p.step_tokens for p in plans[0]] == [p.step_tokens for p in plans[1]]
    assert plans_digest(plans[0]) == plans_digest(plans[1])


def test_rank_zero_starts_a_sequence_before_the_other_ranks_hear_of_it():
    """A start rank 0 refuses (a bad grammar: only rank 0 compiles grammars) reaches no other
    rank, so every rank's slots stay alike; a start rank 0 makes is sent on."""
    from ktflow.backends.sampling import SamplingParams
    from ktflow.errors import InputError
    from ktflow.serve.ranks import RanksRunner

    made = []

    class Inner:
        slots, max_seq_len, vocab_size = 2, 64, 16

        def start(self, slot, params, prompt_ids, reuse, source):
            if prompt_ids == [9]:
                raise InputError("this grammar cannot be compiled")
            made.append(slot)

    class Sent(list):
        def send(self, msg):
            self.append(msg)

    channel = Sent()
    runner = RanksRunner(Inner(), channel)
    with pytest.raises(InputError, match="grammar"):
        runner.start(0, SamplingParams(), [9])
    assert channel == [] and made == []
    runner.start(1, SamplingParams(), [1, 2, 3], 2, 0)
    assert made == [1] and [(m["op"], m["slot"], m["reuse"], m["source"]) for m in channel] == [("start", 1, 2, 0)]
