"""The trained-model workflow (issue 19): benchmarks/train_small_moe.py makes a checkpoint that
ktflow and transformers read alike, benchmarks/fidelity.py measures deferral, expert
skipping and expert formats on it, and benchmarks/placement_hits.py checks placement from a
routing profile on its held-out text. Run here with a few steps (the real run is in the
benchmark); plus the verifier's view of expert skipping."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ktflow
from ktflow.ir.ops import Op
from ktflow.ir.verify import violations

BENCH = Path(__file__).parent.parent / "benchmarks"


def train_tiny(out: Path, device: str = "cpu", steps: int = 3, *extra: str) -> dict:
    """train_small_moe.py --size tiny for a few steps into `out`; its train_report.json."""
    p = subprocess.run([sys.executable, str(BENCH / "train_small_moe.py"), "--size", "tiny", "--steps", str(steps),
                        "--corpus-mb", "0.3", "-o", str(out), "--jsonl", str(out.parent / "t.jsonl"), "--device", device,
                        *extra], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "train_report.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("moe") / "tiny"
    train_tiny(out)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_training_is_deterministic_by_seed(trained, tmp_path, device):
    """The same seed trains the same weights, bit for bit (on the GPU too: deterministic kernels)."""
    if device == "cpu":
        first = json.loads((trained / "train_report.json").read_text())
    else:
        first = train_tiny(tmp_path / "a", device, steps=20)
    again = train_tiny(tmp_path / "b", device, steps=first["steps"])
    assert len(again["weights_sha256"]) == 64
    assert again["weights_sha256"] == first["weights_sha256"]
    assert again["heldout_perplexity"] == first["heldout_perplexity"]


def test_a_time_limit_stops_training_and_saves_what_ran(tmp_path):
    pytest.importorskip("transformers")
    report = train_tiny(tmp_path / "t", "cpu", 1000, "--time-limit", "0")
    assert (report["steps"], report["planned_steps"]) == (1, 1000)
    assert report["tokens"] == 16 * 128 and (tmp_path / "t" / "config.json").exists()


def test_sorted_experts_train_like_transformers_experts():
    """The training forward of the routed experts (tokens sorted by expert, gathers both ways) gives
    transformers' loss and gradients, to float32 rounding."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(BENCH))
    from train_small_moe import SIZES, use_sorted_experts
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=300, **SIZES["tiny"]["model"]))
    with torch.no_grad():  # a router that prefers some experts, so the per-expert row counts differ
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.3)
    ids = torch.randint(0, 300, (4, 48))

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = loss_and_grads()
    assert use_sorted_experts(model) == 3
    got_loss, got = loss_and_grads()
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert set(got) == set(want) and any("experts.gate_up_proj" in n for n in got)
    for n in want:
        assert float((got[n] - want[n]).abs().max()) <= 1e-5 * float(want[n].abs().max()) + 1e-9, n


def test_trained_checkpoint_reads_alike_in_ktflow_and_transformers(trained):
    from transformers import AutoModelForCausalLM

    report = json.loads((trained / "train_report.json").read_text())
    assert report["steps"] == 3 and report["heldout_tokens"] > 0 and report["heldout_perplexity"] > 1
    c = ktflow.compile(ktflow.load(trained), hw="cpu", dtype="float32", max_seq_len=32)
    ids = torch.tensor([[3, 50, 700, 12, 9]])
    got, _ = ktflow.execute(c, ids)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)(ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_the_trained_mtp_layer_reads_alike_in_ktflow_and_in_training(trained):
    """The MTP layer train_small_moe.py trains and saves (layer num_hidden_layers, declared in
    config.json): ktflow's MTP graph over the model's kept hidden states gives the training
    module's logits (row i: token i + 2)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ktflow.runtime.state import State

    sys.path.insert(0, str(BENCH))
    from train_small_moe import MTPLayer

    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    mtp = MTPLayer(model).eval()
    p = f"model.layers.{layers}."
    saved = {k[len(p):]: v for k, v in load_file(str(next(trained.glob("model*.safetensors")))).items()
             if k.startswith(p)}
    own = {"enorm.weight": mtp.enorm.weight, "hnorm.weight": mtp.hnorm.weight, "eh_proj.weight": mtp.eh_proj.weight,
           "shared_head.norm.weight": mtp.block.model.norm.weight}
    mtp.block.model.layers[0].load_state_dict({k: v for k, v in saved.items() if k not in own})
    with torch.no_grad():
        for k, w in own.items():
            w.copy_(saved[k])
        ids = torch.tensor([[3, 50, 700, 12, 9, 41, 8]])
        want = mtp(model, ids, labels=False).logits[0]
    km = ktflow.load(trained)
    opts = dict(hw="cpu", dtype="float32", max_seq_len=32)
    main, draft = ktflow.compile(km, speculate=0, **opts), ktflow.compile(km.mtp(), **opts)
    state = State(main.plans.model.fingerprint, 1, 32, keep_hidden=True)
    _, state = ktflow.execute(main, ids, state)
    got, _ = ktflow.execute(draft, ids[:, 1:], logits="all", hidden=state.hidden_out[:, :-1])
    assert float((got[0] - want).norm() / want.norm()) < 1e-4


def test_fidelity_table_runs_on_the_trained_model(trained, tmp_path):
    out = tmp_path / "f.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "fidelity.py"), str(trained), "--seqs", "1", "--len", "24",
                        "--prompt", "8", "--defer", "1", "--formats", "int8", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"exact", "defer 1", "skip 1", "int8 experts"}
    assert rows["exact"]["kl"] == 0.0 and rows["exact"]["top1_changed"] == 0.0
    assert all(r["kl"] >= -1e-6 and r["positions"] == 24 - 8 for r in rows.values())


def test_deferral_speed_and_cost_table_runs_on_the_trained_model(trained, tmp_path):
    """benchmarks/defer_speed.py (its CPU dry run): each plan's deferral per MoE layer, and the
    accuracy of exactly that deferral against the exact plan."""
    out = tmp_path / "d.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "defer_speed.py"), str(trained), "--device", "cpu", "--seqs", "1",
                        "--prompt", "8", "--decode", "8", "--rounds", "1", "--kl-seqs", "2", "--kl-len", "24",
                        "--defer", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"exact", "auto", "d=1"}
    assert rows["exact"]["deferred"] == [0, 0, 0] and rows["exact"]["kl"] == 0.0 and rows["exact"]["vs_exact"] == 1.0
    assert rows["d=1"]["deferred"] == [1, 1, 0] and rows["d=1"]["kl"] > 0
    assert all(r["decode_tok_s"] > 0 and r["positions"] == 2 * (24 - 16) for r in rows.values())


def test_placement_hits_runs_on_the_trained_model(trained, tmp_path):
    """benchmarks/placement_hits.py: a profile from training text, plans with and without it at the
    same budget, the held-out picks that land on each plan's GPU experts, per layer."""
    out = tmp_path / "h.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "placement_hits.py"), str(trained), "--shares", "0.25",
                        "--profile-seqs", "2", "--seqs", "2", "--len", "24", "--corpus-mb", "0.3", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = json.loads((trained / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(rows) == moe_layers and all(r["share"] == 0.25 for r in rows)
    # the budget puts a quarter of the experts on the GPU without a profile; the cause of each GPU part says
    # the share of its layer's picks it expects
    assert sum(r["gpu_experts_uniform"] for r in rows) >= 0.25 * cfg["n_routed_experts"] * moe_layers
    assert all(r["expected"] is not None for r in rows if r["gpu_experts"])
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in ("profiled", "uniform", "best"))


def test_cache_hits_runs_on_the_trained_model(trained, tmp_path):
    """benchmarks/cache_hits.py: per held-out sequence the decoded tokens' picks served by each
    policy; the oracle (each sequence's own busiest experts) is the static bound."""
    out = tmp_path / "c.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "cache_hits.py"), str(trained), "--shares", "0.25", "--seqs", "2",
                        "--len", "24", "--prompt", "8", "--every", "4", "--profile-seqs", "2", "--corpus-mb", "0.3",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = json.loads((trained / "config.json").read_text())
    assert len(rows) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    for r in rows:
        assert all(0.0 <= r[k] <= 1.0 for k in ("uniform", "profiled", "cache", "oracle"))
        assert r["oracle"] >= max(r["uniform"], r["profiled"]) - 1e-9 and r["copied_per_token"] >= 0
    p = subprocess.run([sys.executable, str(BENCH / "cache_hits.py"), str(trained), "--shares", "0.25", "--seqs", "4",
                        "--len", "24", "--prompt", "8", "--every", "4", "--batch", "2", "--profile-seqs", "2",
                        "--corpus-mb", "0.3", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    batched = [json.loads(line) for line in out.read_text().splitlines()][len(rows):]
    assert len(batched) == len(rows) and all(r["batch"] == 2 for r in batched)
    k = cfg["num_experts_per_tok"]
    assert all(k <= r["reads_per_step"] <= 2 * k for r in batched)  # two rows' picks, each expert read once


def test_the_scaled_model_computes_what_the_trained_one_does(trained, tmp_path):
    """benchmarks/scale_moe.py pads every expert's intermediate size with zeros: the experts hold
    4x the bytes, and the logits (bf16 and int8 experts) and the routing are the trained model's."""
    from ktflow.runtime.routing import record_routing

    cfg = json.loads((trained / "config.json").read_text())
    inter = 4 * cfg["moe_intermediate_size"]
    out = tmp_path / "scaled"
    p = subprocess.run([sys.executable, str(BENCH / "scale_moe.py"), str(trained), "--inter", str(inter), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["moe_intermediate_size"] == inter
    assert (out / "heldout.safetensors").exists() and (out / "tokenizer.json").exists()
    ids = torch.tensor([[3, 50, 700, 12, 9, 77]])
    for fmt in ("bf16", "int8"):
        got = []
        for d in (trained, out):
            c = ktflow.compile(ktflow.load(d), hw="cpu", max_seq_len=32, backend="native", expert_format=fmt)
            got.append((ktflow.execute(c, ids)[0], record_routing(c, [ids[0].tolist()], progress=False)))
            node = next(n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS)
            assert node.attrs.inter == (cfg["moe_intermediate_size"] if d == trained else inter)
        torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-3, atol=1e-3)  # the sums' order: float rounding
        assert got[0][1].layers == got[1][1].layers
    bad = subprocess.run([sys.executable, str(BENCH / "scale_moe.py"), str(trained), "--inter", "8", "-o",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "below the model's moe_intermediate_size" in bad.stderr


def test_cache_speed_runs_its_four_plans(trained, tmp_path):
    """benchmarks/cache_speed.py (here on the CPU, where the GPU lane runs on the CPU too: the code
    path, not a speed): uniform, profiled, cached and frozen plans over held-out conversations, the
    cache refilled after each prompt and every N decoded tokens. The profile holds the prompts'
    routing only (--profile-decode 0), so the cache plan holds every split layer's GPU experts as
    a cache: priced from curves, a cache against static slots is a near tie on this barely trained
    model (seeds 3 and 4 of train_small_moe.py, or one trained on another CPU, get no cache on any
    layer, and then no cache runs)."""
    out = tmp_path / "s.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "cache_speed.py"), str(trained), "--device", "cpu", "--backend",
                        "native", "--shares", "0.25", "--seqs", "2", "--prompt", "8", "--decode", "8", "--every", "4",
                        "--rounds", "1", "--profile-seqs", "2", "--profile-decode", "0", "--corpus-mb", "0.3",
                        "--hw", "rtx4090-desktop", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(row[f"{v}_tok_s"] > 0 for v in ("uniform", "profiled", "cache", "frozen"))
    assert row["hw"] == "rtx4090-desktop" and row["profile_decode"] == 0  # the plans compiled with that profile's rates
    # warm-up (a prompt and 8 tokens) and 2 conversations: a refill after each prompt and every 4 decoded tokens
    assert row["refills"] == 3 * (1 + 8 // 4)
    # the static plans' held-out hit shares, and the copies' cost and lag
    assert all(0.0 <= row[f"{v}_hit"] <= 1.0 for v in ("uniform", "profiled", "frozen"))
    assert row["host_ms_per_token"] > 0.0 and row["copy_lag_tokens"] >= 0.0
    assert "round 1 of 1: uniform" in p.stdout  # each round said as it ends (a run cut short keeps them)
    assert 0.0 <= row["cache_hit"] <= 1.0 and row["copied_mb_per_token"] >= 0.0
    assert row["cache_hit_predicted"] is None and "nothing: unpriced" in p.stdout  # no curves to predict from


def test_the_cache_policy_serves_a_conversations_own_experts():
    """cache_hits.cache_run: filled from the prompt's picks, then refilled from each block's; a
    conversation that keeps to two experts is served entirely after the prompt, and only the
    first refill copies."""
    sys.path.insert(0, str(BENCH))
    from cache_hits import cache_run

    picks = torch.tensor([[5, 6]] * 12)
    hits, copied = cache_run(picks, first={0, 1}, prompt=4, every=4, s=2, experts=8)
    assert hits == 2 * 8 and copied == 2
    moving = torch.tensor([[5, 6]] * 4 + [[1, 2]] * 4 + [[1, 2]] * 4)
    hits, copied = cache_run(moving, first={0, 1}, prompt=4, every=4, s=2, experts=8)
    assert hits == 8 and copied == 2 + 2  # the first block after the prompt misses; the refill catches up


def test_a_batchs_cache_serves_each_steps_expert_reads_once():
    """cache_run over a batch in lockstep (picks [tokens, rows, top_k]): a step reads an expert
    once however many rows picked it, the refills count every row's picks."""
    sys.path.insert(0, str(BENCH))
    from cache_hits import cache_run, reads_of

    both = torch.tensor([[[5, 6], [5, 7]]] * 8)  # rows share expert 5: a step reads 5, 6 and 7
    assert int(reads_of(both[4:], 8).sum()) == 3 * 4
    hits, copied = cache_run(both, first={0, 1}, prompt=4, every=2, s=2, experts=8)
    assert hits == 2 * 4 and copied == 2  # the prompts put 5 (counted twice) and 6 (tie, lower id) in the slots


def test_verifier_takes_declared_skipping_only(tiny_dirs):
    """Picks past top_k - skip may go uncomputed where the layer declares skip; a node that drops
    them without it, or nodes disagreeing on it, break rule V10."""
    d, _ = tiny_dirs("qwen3_moe")
    g = ktflow.load(d).graph()
    k = next(n.attrs.top_k for n in g.nodes if n.op == Op.ROUTED_EXPERTS)

    def cut(skip):
        return g.map(lambda n: replace(n, attrs=replace(n.attrs, ranks=(0, k - 1), skip=skip))
                     if n.op == Op.ROUTED_EXPERTS else n)

    assert not [v for v in violations(cut(1)) if v[0] == "V10"]
    assert any(v[0] == "V10" and "computed by no node" in v[2] for v in violations(cut(0)))


def test_a_plan_with_declared_skipping_saves_and_loads(tiny_dirs, tmp_path):
    sys.path.insert(0, str(BENCH))
    from fidelity import skip_lowest

    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    c = ktflow.compile(model, hw="cpu", dtype="float32", max_seq_len=16, numa_nodes=1,
                       passes=[("after:place_by_intensity", skip_lowest(1))])
    assert any(n.attrs.skip == 1 for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS)
    c.save(tmp_path / "p.json")
    back = ktflow.Compiled.load(tmp_path / "p.json", model)  # the plan check takes `skip` as placed
    assert [n.attrs for n in back.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS] == \
        [n.attrs for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS]


def test_prefetch_hits_guesses_the_next_layers_picks(trained, tmp_path):
    """benchmarks/prefetch_hits.py: its router replay gives the router's own picks, and each guess's
    share of the next layer's picks is a share (m = k and 2k; the last token's only at m = k)."""
    sys.path.insert(0, str(BENCH))
    from prefetch_hits import route
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    layer = next(i for i, lay in enumerate(m.model.layers) if hasattr(lay.mlp, "gate"))
    g = m.model.layers[layer].mlp.gate
    g.n_group, g.topk_group, g.n_routed_experts = m.config.n_group, m.config.topk_group, m.config.n_routed_experts
    x = torch.randn(64, m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    k = m.config.num_experts_per_tok
    assert torch.equal(route(g, x, k).sort(-1)[0], g(x)[2].sort(-1)[0])
    out = tmp_path / "p.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "prefetch_hits.py"), str(trained), "--seqs", "2", "--len", "40",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["m"] for r in rows} == {k, 2 * k}
    assert all(0.0 <= r["pre_gate"] <= 1.0 and r["chance"] == round(r["m"] / r["experts"], 4) for r in rows)
    assert all((r["last_token"] is None) == (r["m"] == 2 * k) for r in rows)
