"""Recording real routing (`ktflow profile`, runtime/routing.py): the counts are the routers'
picks, the profile is one placement reads, and the errors name what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ktflow
from ktflow.tools.cli import main
from ktflow.costmodel.routing import RoutingProfile
from ktflow.errors import ConfigError
from ktflow.costmodel.hw import PRESETS, with_this_gpus_memory
from ktflow.runtime.routing import RoutingRecorder, record_routing


def _biased_copy(src, dst, layer: int, favoured: list[int], experts: int):
    """The checkpoint with layer `layer`'s correction bias so large on `favoured` that every token
    picks exactly those experts (the bias decides the choice, not the weights)."""
    shutil.copytree(src, dst)
    key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        if key in t:
            bias = torch.zeros(experts, dtype=t[key].dtype)
            bias[favoured] = 1e3
            t[key] = bias
            save_file(t, f, metadata={"format": "pt"})
            return dst
    raise AssertionError(f"{key} not in the checkpoint")


@pytest.mark.parametrize("backend", ["torch_ref", "native"])
def test_recorded_routing_is_the_routers_picks(backend, tiny_dirs, tmp_path):
    d, _ = tiny_dirs("deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    layer, experts, k = cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    assert experts // cfg["n_group"] >= k  # the favoured experts share a group: nothing else can be picked
    biased = _biased_copy(d, tmp_path / "biased", layer, list(range(k)), experts)
    c = ktflow.compile(ktflow.load(biased), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=32,
                       backend=backend)
    prof = record_routing(c, [[1, 2, 3, 4, 5], [6, 7, 8]], decode=3, pairs=True, progress=False)
    assert prof.tokens == 5 + 3 + 2 * 3  # every prompt token and every decoded token (the last is not fed back)
    assert prof.layers[layer][:k] == [1.0] * k and sum(prof.layers[layer][k:]) == 0.0
    assert prof.pairs[layer][0][1] == 1.0 and prof.pairs[layer][0][0] == 1.0 and prof.pairs[layer][k][k + 1] == 0.0
    assert prof.model_type == "deepseek_v3"
    # the cache curves: k slots refilled from the prompt serve every decoded pick, copying nothing
    assert set(prof.cache) == {8, 16, 32, 64, 128, 256}
    curve = prof.cache[32][layer]
    assert len(curve.hits) == experts - 1 and curve.hits[k - 1] == 1.0 and curve.copies[k - 1] == 0.0
    assert curve.hits[k - 2] == pytest.approx((k - 1) / k)
    # the two conversations decoded together read the same k experts a step: the same curve
    assert set(prof.cache_batched) == {2} and set(prof.cache_batched[2]) == {8, 16, 32, 64, 128, 256}
    both = prof.cache_batched[2][32][layer]
    assert both.hits[k - 1] == 1.0 and both.hits[k - 2] == pytest.approx((k - 1) / k) and both.copies[k - 1] == 0.0
    # teacher forcing: a continuation fed a decode step a token routes as the whole text prefilled
    plain_c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=32,
                             backend=backend)
    text = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 2]
    forced = record_routing(plain_c, [text[:4]], progress=False, continuations=[text[4:]])
    whole = record_routing(plain_c, [text], progress=False)
    assert forced.tokens == whole.tokens == len(text) and forced.layers == whole.layers and forced.cache
    assert forced.cache_batched is None  # one conversation makes no batch
    # unbiased: fractions of real picks, each token k of them
    plain = record_routing(ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32",
                                          max_seq_len=32, backend=backend), [[1, 2, 3, 4, 5, 6]], progress=False)
    assert abs(sum(plain.layers[layer]) - k) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_decode_step_counts_its_routing_on_the_gpu(tiny_dirs, tmp_path):
    """On the cuda_graph backend the decode step is one captured graph: its routers' picks are
    counted inside it, on every replay (single steps and greedy runs of K steps a launch), and
    the counts equal those of the same plan issued eagerly."""
    from ktflow.backends.native import binding as native
    from ktflow.runtime.execute import decode_greedy

    if not native.available():
        pytest.skip("needs the native module")
    d, _ = tiny_dirs("deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    layer, experts, k = cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    biased = _biased_copy(d, tmp_path / "biased", layer, list(range(k)), experts)
    opts = dict(hw=with_this_gpus_memory(PRESETS["paper-a100"]), device="cuda", dtype="bfloat16", max_seq_len=64,
                backend="cuda_graph")
    c = ktflow.compile(ktflow.load(biased), **opts)
    assert c.decode.capture
    prof = record_routing(c, [[1, 2, 3, 4, 5], [6, 7, 8]], decode=5, pairs=True, progress=False)
    assert prof.tokens == 5 + 3 + 2 * 5  # the decode steps after the first replay the captured graph
    assert prof.layers[layer][:k] == [1.0] * k and sum(prof.layers[layer][k:]) == 0.0
    assert prof.pairs[layer][0][1] == 1.0

    def counted(capture: bool, beside: bool = False) -> dict:
        """The decode steps' counts; with `beside`, those of a recorder attached next to the
        executor's (`attach`: a RecorderTee captured into the graph), which must count the same."""
        from ktflow.runtime.routing import attach

        c = ktflow.compile(ktflow.load(d), **opts)
        ex = c.executor(c.decode)
        ex.runner.capture = capture
        nxt, state = ktflow.execute(c, torch.tensor([[3, 1, 4, 1, 5]]), logits="argmax")
        ex.recorder = first = RoutingRecorder()
        second = RoutingRecorder()
        if beside:
            attach(c, second)
        for _ in range(3):  # one step a launch, then greedy runs of 4 a launch (eager first, then replayed)
            nxt, state = ktflow.execute(c, nxt, state, logits="argmax")
        for _ in range(3):
            nxt = decode_greedy(c, nxt, state, 4)[:, -1:]
        ex.recorder = None
        if beside:
            assert all(torch.equal(first.counts[j], second.counts[j]) for j in first.counts)
        return {j: counts.cpu() for j, counts in first.counts.items()}, {j: int(r) for j, r in first.rows.items()}

    (replayed, rows), (eager, rows_eager) = counted(True), counted(False)
    assert set(rows.values()) == {3 + 12} and rows == rows_eager
    assert all(torch.equal(replayed[j], eager[j]) for j in eager) and all(int(v.sum()) == 15 * k for v in eager.values())
    teed, teed_rows = counted(True, beside=True)
    assert teed_rows == rows and all(torch.equal(teed[j], eager[j]) for j in eager)


def test_recorder_counts_each_pick():
    rec = RoutingRecorder(pairs=True)
    rec.add(3, torch.tensor([[0, 2], [2, 1]]), 4)
    rec.add(3, torch.tensor([[2, 3]]), 4)
    prof = rec.profile()
    assert prof.layers[3] == [round(1 / 3, 6), round(1 / 3, 6), 1.0, round(1 / 3, 6)] and prof.tokens == 3
    assert prof.pairs[3][2][1] == round(1 / 3, 6) and prof.pairs[3][0][1] == 0.0
    with pytest.raises(ValueError, match="no routing was recorded"):
        RoutingRecorder().profile()


def test_read_gives_each_counted_layers_picks_and_rows():
    """The host's one read of the counters (the expert cache's step end, `profile`): every asked
    layer the recorder counted, with its own picks and rows (layers it did not count left out)."""
    rec = RoutingRecorder()
    rec.add(1, torch.tensor([[0, 2], [2, 3]]), 4)
    rec.add(3, torch.tensor([[1, 0, 5]]), 6)
    got = rec.read([1, 2, 3])
    assert set(got) == {1, 3}
    assert got[1][0].tolist() == [1, 0, 2, 1] and got[1][1] == 2
    assert got[3][0].tolist() == [1, 1, 0, 0, 0, 1] and got[3][1] == 1
    assert rec.read([2]) == {}


def test_ktflow_profile_writes_what_compile_reads(demo_dir, tmp_path, capsys):
    from ktflow.serve.demo_tokenizer import write_demo_tokenizer

    d = tmp_path / "demo"
    shutil.copytree(demo_dir, d)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The first prompt about experts\n\nA second prompt, longer than the first one\n")
    out = tmp_path / "routing.json"
    args = ["profile", str(d), "--prompts", str(prompts), "-o", str(out), "--decode", "4", "--hw", "cpu"]
    assert main(args) == 2 and not out.exists()  # no tokenizer.json yet (bad input: exit 2)
    assert "tokenizer.json" in capsys.readouterr().err
    write_demo_tokenizer(d)
    assert main(args) == 0
    prof = RoutingProfile.load(out)
    assert prof.tokens > 8 and prof.layers
    assert prof.cache and all(len(c.hits) == len(prof.layers[layer]) - 1 for c2 in prof.cache.values()
                              for layer, c in c2.items())
    out_text = capsys.readouterr().out
    assert "an expert cache of a quarter of each layer's experts" in out_text
    assert set(prof.cache_batched) == {2} and "2 conversations decoded together: it served" in out_text
    model = ktflow.load(d)
    split = None
    for budget in (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2):  # until some layer's experts are split
        compiled = ktflow.compile(model, hw="rtx4090-desktop", routing_profile=str(out), device="cpu",
                                  vram_budget_gb=budget, allow_oversize=True)
        nodes = [n for n in compiled.decode.ir.nodes if n.op.value == "routed_experts"]
        gpu = {n.attrs.layer: set(n.attrs.ids) for n in nodes if n.place.device.value == "gpu"}
        cpu = {n.attrs.layer: set(n.attrs.ids) for n in nodes if n.place.device.value == "cpu"}
        split = next((j for j in gpu if j in cpu and gpu[j]), None)
        if split is not None:
            break
    assert split is not None, "no budget split a layer's experts between the devices"
    fr = prof.layers[split]  # placement read the profile: the GPU holds that layer's most picked experts
    assert min(fr[e] for e in gpu[split]) >= max(fr[e] for e in cpu[split])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["profile", str(d), "--prompts", str(empty), "-o", str(tmp_path / "x.json")]) == 2
    assert "has no prompts" in capsys.readouterr().err


def test_recording_refuses_a_plan_run_as_a_whole(tiny_dirs):
    d, _ = tiny_dirs("qwen3_moe")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=16)
    ex = c.executor(c.decode)
    ex.runner = object()  # as a backend that runs the plan as a whole (cuda_graph) has one
    ex.recorder = RoutingRecorder()
    with pytest.raises(ConfigError, match="backend='native'"):
        ex.run(torch.tensor([[1]]), ktflow.runtime.state.State(c.plans.model.fingerprint, 1, 16, position=1))


def test_a_ragged_steps_padding_rows_are_not_counted(tiny_dirs):
    """SlotPool decodes rows 0..b-1 of a bucket; rows not listed are padding (token 0): the
    recorder counts the listed rows' picks only, weighing each row by what set_rows says."""
    from ktflow.runtime.slots import SlotPool

    d, _ = tiny_dirs("deepseek_v3")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=32, max_batch=4,
                       backend="native")
    pool = SlotPool(c, 4)
    pool.start(2)
    pool.prefill(2, torch.tensor([[5, 6, 7]]))
    rec = RoutingRecorder()
    c.executor(c.decode).recorder = rec
    pool.decode([2], [9])  # bucket 4: rows 0, 1 and 3 are padding
    pool.decode([2], [11])
    c.executor(c.decode).recorder = None
    assert rec.rows and all(int(r) == 2 for r in rec.rows.values())
    k = json.loads((d / "config.json").read_text())["num_experts_per_tok"]
    assert all(int(counts.sum()) == 2 * k for counts in rec.counts.values())


def test_ktflow_run_records_the_routing_it_runs(demo_dir, tmp_path, capsys):
    """`ktflow run --record-routing` writes the picks of every token the run routed (the prompt and
    each fed-back decoded token) as a profile compile reads: the counts `record_routing` makes of
    the same prompt and greedy tokens. Beside the expert cache (which zeroes its own counters at
    every refill) it records the same counts."""
    ids = [5, 17, 3, 9, 44, 2]
    model = ktflow.load(demo_dir)
    opts = dict(device="cpu", backend="native", hw="rtx4090-desktop", max_seq_len=64, allow_oversize=True)
    budget = next(gb for gb in (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2)  # one that splits a layer: a cache
                  if any(n.op.value == "routed_experts" and n.attrs.cached for n in ktflow.compile(
                      model, expert_cache=True, vram_budget_gb=gb, **opts).decode.ir.nodes))
    base = ["run", str(demo_dir), "--input-ids", " ".join(map(str, ids)), "--max-new-tokens", "6", "--device", "cpu",
            "--backend", "native", "--hw", "rtx4090-desktop", "--max-seq-len", "64", "--vram-budget-gb", str(budget),
            "--allow-oversize"]
    alone, cached = tmp_path / "alone.json", tmp_path / "cached.json"
    assert main([*base, "--record-routing", str(alone)]) == 0
    assert f"wrote {alone}" in capsys.readouterr().out
    want = record_routing(ktflow.compile(model, vram_budget_gb=budget, **opts), [ids], 5, progress=False)
    got = RoutingProfile.load(alone)
    assert got.tokens == want.tokens == len(ids) + 5 and got.layers == want.layers
    assert main([*base, "--record-routing", str(cached), "--expert-cache", "--refill-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "expert cache: layers" in out and f"wrote {cached}" in out
    assert RoutingProfile.load(cached).layers == got.layers
    # compile reads it
    assert main(["compile", str(demo_dir), "--routing-profile", str(alone), "--hw", "rtx4090-desktop", "--device",
                 "cpu", "-o", str(tmp_path / "plan.json")]) == 0


def test_attach_and_detach_leave_a_recorder_beside_them_counting():
    """A recorder attached beside another (the expert cache's) gets every call; detaching it
    leaves the other attached alone."""
    from types import SimpleNamespace

    from ktflow.runtime.routing import RecorderTee, attach, detach

    executors = {"decode": SimpleNamespace(recorder=None), "prefill": SimpleNamespace(recorder=None)}
    compiled = SimpleNamespace(decode="decode", prefill=["prefill"], executor=lambda plan: executors[plan])
    cache_rec, run_rec = RoutingRecorder(), RoutingRecorder()
    executors["decode"].recorder = cache_rec
    attach(compiled, run_rec)
    tee = executors["decode"].recorder
    assert isinstance(tee, RecorderTee) and executors["prefill"].recorder is run_rec
    tee.add(1, torch.tensor([[0, 2]]), 4)
    assert cache_rec.counts[1].tolist() == run_rec.counts[1].tolist() == [1, 0, 1, 0]
    detach(compiled, run_rec)
    assert executors["decode"].recorder is cache_rec and executors["prefill"].recorder is None
