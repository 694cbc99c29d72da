"""The cuda_graph backend: hybrid plans (GPU attention, router, shared experts; CPU routed
experts on the native queue through host nodes) against torch_ref on the same plan, with and
without Expert Deferral; graph replay against eager issue of the same step; one graph launch per
decoded token; the errors. GPU tests skip without CUDA; the plan checks run anywhere."""

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.errors import InputError, KtflowError, PlanError, ResourceError
from ktflow.ir.ops import Op

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and native.available()),
                         reason="needs a CUDA GPU and the native module")
FAMILIES = ["deepseek_v3", "deepseek_v2_lite", "qwen2_moe", "qwen3_moe", "mixtral_sliding", "glm4_moe"]
TOL = 2e-2  # of a token's logits norm: bf16 on both sides, different kernels
#: a token whose router sees a near tie may pick another expert in bf16 on one side (on the CPU
#: too: deepseek_v3's prompt below has one such token of 24, at 19% error, native vs torch_ref);
#: at most this fraction of the run's tokens (prompt and decode steps together: a 2-token decode
#: step alone cannot tell one such tie from a broken step) may, each within compare.FLIP_CEIL.
#: FLIP_TOL: test_slots' bound on each token of sequences run alone and in a batch, both
#: on the cuda_graph backend
FLIPS, FLIP_TOL = 0.1, 5e-2


def hw_here():
    """The paper's machine with this GPU's memory and no fixed overheads (so the cost model
    places by intensity alone)."""
    from ktflow.costmodel.hw import PRESETS, Overheads, with_this_gpus_memory

    return with_this_gpus_memory(PRESETS["paper-a100"]).model_copy(update={"overheads": Overheads(
        gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0, cpu_sync_us=0)})


def hybrid(model, device="cuda", **options):
    """A bf16 hybrid plan at a VRAM budget fixed by the model (never by this card's memory): the
    dense nodes' bytes, the KV caches and 2.5 experts per MoE layer. Placement ranks units by decode
    time saved per byte, so attention, routers, shared experts and lm_head go to the GPU, then
    experts (uniform routing: in graph order, so the first MoE layers' experts) while the budget
    lasts; the rest of the experts and whatever ranks below them (the tiny models' embedding) stay
    on the CPU. device="cpu" gives the same plan run on the CPU."""
    opts = dict(hw=hw_here(), device=device, dtype="bfloat16", max_seq_len=64, max_batch=options.pop("max_batch", 2))
    probe = ktflow.compile(model, vram_budget_gb=1.0, **opts)
    nodes = probe.decode.ir.nodes
    dense = sum(n.weight_elems() * 2 for n in nodes if n.op != Op.ROUTED_EXPERTS)  # held in the plan's bf16
    per_expert = max(n.weight_elems() / n.attrs.experts for n in nodes if n.op == Op.ROUTED_EXPERTS) * 2
    moe_layers = sum(1 for n in nodes if n.op == Op.ROUTED_EXPERTS)
    budget = dense + probe.decode.memory.kv_cache_bytes + 2.5 * moe_layers * per_expert
    return ktflow.compile(model, vram_budget_gb=budget / 1e9, **opts, **options)


def run_steps(compiled, ids, steps, seed=5):
    g = torch.Generator().manual_seed(seed)
    logits, state = ktflow.execute(compiled, ids)
    out = [logits]
    for _ in range(steps):
        nxt = torch.randint(0, compiled.vocab_size, (ids.shape[0], 1), generator=g)
        logits, state = ktflow.execute(compiled, nxt, state)
        out.append(logits)
    return out


def argmax_steps(compiled, ids, steps, seed=5):
    """run_steps' token ids, each step asked for logits='argmax'."""
    g = torch.Generator().manual_seed(seed)
    nxt, state = ktflow.execute(compiled, ids, logits="argmax")
    out = [nxt]
    for _ in range(steps):
        nxt = torch.randint(0, compiled.vocab_size, (ids.shape[0], 1), generator=g)
        got, state = ktflow.execute(compiled, nxt, state, logits="argmax")
        out.append(got)
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@gpu
def test_argmax_mode_takes_the_replayed_steps_argmax_on_the_gpu(tiny_dirs):
    """logits='argmax' through the captured graph: the same ids as the argmax of the logits the
    same steps return (the graph is deterministic: same inputs, same logits)."""
    d, _ = tiny_dirs("qwen3_moe")
    c = hybrid(ktflow.load(d), backend="cuda_graph")
    ids = torch.randint(0, c.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got = run_steps(c, ids, 5)
    am = argmax_steps(c, ids, 5)
    assert c.executor("decode").runner.bound[2].graph is not None
    for i, (x, y) in enumerate(zip(am, got, strict=True)):
        assert x.dtype == torch.int64 and x.shape == (2, 1), i
        assert torch.equal(x, y[:, -1:].argmax(-1)), i


def embed_on(device: str):
    """A custom pass (after placement) that puts the embedding on `device` ("cpu" or "gpu"),
    whatever the cost model chose: on the CPU as it leaves a large vocabulary's table (the decode
    step's host prologue then looks the ids up), on the GPU as it takes a small one when the
    VRAM budget has room for it. `hybrid`'s budget does not pin it: experts rank above the
    embedding by decode time saved per byte, so whether the table fits beside them follows from
    the weights' byte counts (since 64cceeb the tiny models' embedding is left on the CPU)."""
    from dataclasses import replace

    from ktflow.ir.types import Device, Placement

    def pin(g, ctx):
        return g.map(lambda n: replace(n, place=Placement(Device(device), cause=f"test: embedding on the {device}"))
                     if n.op == Op.EMBED else n)

    pin.__name__ = pin.__qualname__ = f"embed_on_{device}"
    return pin


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_the_embedding_pinned_either_way_computes_the_same(where, tiny_dirs):
    """embed_on, as the greedy test uses it, on any machine (device='cpu' runs the hybrid plan on
    the CPU): the embedding is where it says, the token ids or the looked-up rows cross to the
    GPU lane once, and the plan computes what the cost model's plan computes, bit for bit."""
    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    pinned = hybrid(model, device="cpu", backend="torch_ref", passes=[("after:place_by_intensity", embed_on(where))])
    plain = hybrid(model, device="cpu", backend="torch_ref")
    g = pinned.decode.ir
    assert next(n for n in g.nodes if n.op == Op.EMBED).place.device.value == where
    crossing = {"tokens.to_gpu", "embed.to_gpu"} & {n.name for n in g.nodes}
    assert crossing == {"tokens.to_gpu" if where == "gpu" else "embed.to_gpu"}
    # lowering marks the embedding's task as one the host computes before the step, no other
    on_host = {n.attrs.task for n in g.nodes if n.op == Op.SUBMIT and n.attrs.on_host}
    assert on_host == ({"embed"} if where == "cpu" else set())
    assert any(n.op == Op.SUBMIT and n.attrs.task != "embed" for n in g.nodes)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    for x, y in zip(run_steps(pinned, ids, 3), run_steps(plain, ids, 3), strict=True):
        assert torch.equal(x, y)


@gpu
@pytest.mark.parametrize("case,defer,embed_cpu", [*((f, None, False) for f in FAMILIES), ("qwen3_moe", 1, False),
                                                  ("deepseek_v3", 1, False), ("qwen3_moe", None, True),
                                                  ("deepseek_v2_lite", 1, True)])
def test_greedy_runs_of_several_steps_a_launch_equal_one_step_a_launch(case, defer, embed_cpu, tiny_dirs):
    """decode_greedy(steps=K): K steps captured as one graph, each step's argmax fed to the next on
    the GPU and the position advanced there, give the ids K one-step launches give. Each call starts
    from a random token (not the previous call's last id, so a first step that read a stale input
    or embedding would show); calls of K = 4, 4, 2, 4 run eager, captured and replayed graphs, and
    under deferral carry queued tasks between steps; an embedding left on the CPU is looked up on
    the host for a run's first step and on the GPU from its page-locked table for the others."""
    from ktflow.runtime.execute import decode_greedy

    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    # the embedding's place pinned both ways (the test is about both prologues, not the cost model)
    extra = dict(passes=[("after:place_by_intensity", embed_on("cpu" if embed_cpu else "gpu"))])
    one, many = hybrid(model, defer=defer, **extra), hybrid(model, defer=defer, **extra)
    assert embed_cpu == (next(n for n in many.decode.ir.nodes if n.op == Op.EMBED).place.device.value == "cpu")
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    _, s1 = ktflow.execute(one, prompt, logits="argmax")
    _, s2 = ktflow.execute(many, prompt, logits="argmax")
    ks = (4, 4, 2, 4)
    starts = [torch.randint(0, model.config.vocab_size, (2, 1), generator=g) for _ in ks]
    want, got = [], []
    for k, nxt in zip(ks, starts, strict=True):
        for _ in range(k):
            nxt, s1 = ktflow.execute(one, nxt, s1, logits="argmax")
            want.append(nxt)
        got.append(decode_greedy(many, starts[len(got)], s2, k))
    runner = many.executor("decode").runner
    assert {k for (k, _, _), run in runner.bound[2].runs.items() if run.graph} == {4, 2} and s2.position == s1.position
    assert embed_cpu == bool(runner.lookups.get(2))  # the table gathered from on the GPU
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))


@gpu
def test_a_step_failing_mid_issue_leaves_the_cpu_side_ready_for_the_next(tiny_dirs, monkeypatch):
    """A decode step that raises while it is being issued, after its ring was armed and some of its
    doorbells queued (here: the second wait), disarms the ring: the error is the caller's, and the
    next steps run at once (no 30-second ring timeout) with the logits of a plan that never failed."""
    import time

    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    c, ref = hybrid(model), hybrid(model)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(8))
    _, s = ktflow.execute(c, prompt)
    _, sr = ktflow.execute(ref, prompt)
    runner = c.executor("decode").runner
    assert runner.be.submit == "doorbell"
    real = runner.driver.wait_value

    def failing_wait(at: int, message: str):
        """The driver's wait, raising `message` at its `at`-th call from now."""
        calls = iter(range(1, 1 << 30))

        def wait(stream, address, value):
            if next(calls) == at:
                raise RuntimeError(message)
            return real(stream, address, value)
        return wait

    monkeypatch.setattr(runner.driver, "wait_value", failing_wait(2, "injected: the second wait fails"))
    nxt = torch.tensor([[3], [4]])
    with pytest.raises(RuntimeError, match="injected"):
        ktflow.execute(c, nxt, s)
    monkeypatch.setattr(runner.driver, "wait_value", real)
    t0 = time.monotonic()
    for t in range(4):
        tok = torch.tensor([[5 + t], [9 + t]])
        a, s = ktflow.execute(c, tok, s)
        b, sr = ktflow.execute(ref, tok, sr)
        assert (a - b).abs().max() <= 1e-3 * b.abs().max(), t
    assert time.monotonic() - t0 < 10

    # a greedy run of 4 steps failing in its second step: the first step has cleared, rung and
    # waited on every flag once, the second clears them again before it fails
    from ktflow.runtime.execute import decode_greedy

    bound = runner.bound[2]
    per_step = sum(1 for ins in c.decode.instructions  # the waits a step issues: its syncs of tasks with batches
                   if ins.kind == "sync" and bound.tasks[c.decode.ir.by_name(ins.node).inputs[1]])
    # the failure comes at the second step's second wait
    monkeypatch.setattr(runner.driver, "wait_value",
                        failing_wait(per_step + 2, "injected: a wait of the run's second step fails"))
    with pytest.raises(RuntimeError, match="second step fails"):
        decode_greedy(c, torch.tensor([[1], [2]]), s, 4)
    monkeypatch.setattr(runner.driver, "wait_value", real)
    t0 = time.monotonic()
    assert torch.equal(decode_greedy(c, torch.tensor([[1], [2]]), s, 4), decode_greedy(ref, torch.tensor([[1], [2]]), sr, 4))
    assert time.monotonic() - t0 < 10


def test_decode_greedy_refuses_a_run_past_the_cache(demo_dir):
    from ktflow.runtime.execute import decode_greedy

    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=8, dtype="float32")
    nxt, state = ktflow.execute(c, torch.tensor([[1, 2, 3, 4, 5]]), logits="argmax")
    with pytest.raises(InputError, match=r"cannot decode 4 tokens at position 5.*max_seq_len 8"):
        decode_greedy(c, nxt, state, 4)
    with pytest.raises(InputError, match=r"one token per sequence"):
        decode_greedy(c, torch.tensor([[1, 2]]), state, 2)
    assert decode_greedy(c, nxt, state, 3).shape == (1, 3) and state.position == 8


def float32_reference(model, defer):
    """The model in float32 with the same deferral (torch_ref, on the CPU): what the bf16 runs of
    a hybrid plan approximate. A plan computes in its IR's dtype, so this is a compile of its own
    (an options copy of a bf16 plan saying dtype="float32" still runs in bf16); a fixed deferral
    defers the same picks of every MoE layer but the last wherever the experts are placed, so
    the placement does not change the function."""
    return ktflow.compile(model, hw="cpu", device="cpu", dtype="float32", backend="torch_ref", max_seq_len=64,
                          max_batch=2, defer=defer)


def assert_matches_torch_ref(c, model, defer):
    """`c`'s runs (prompt of 12, 6 decode steps, batch 2) against torch_ref on the same bf16 plan:
    each token within the bf16 tolerance, or within twice the model's own bf16 noise at that
    token (torch_ref in bf16 against the model in float32: two bf16 paths may each sit that far
    from float32; some tiny random models are this sensitive, deepseek_v2_lite's about 1.5%), but
    for at most FLIPS of the tokens, each within what one router tie resolved the other way does
    to a token (`compare.FLIP_CEIL`). Returns the per-step errors and torch_ref's runs."""
    from compare import assert_within_bounds_but_for_ties

    ref = ktflow.Compiled(c.plans.model_copy(update={"options": c.plans.options.model_copy(
        update={"backend": "torch_ref"})}), model)
    exact = float32_reference(model, defer)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got, want = run_steps(c, ids, 6), run_steps(ref, ids, 6)
    a, b = torch.cat(got, 1).float(), torch.cat(want, 1).float()
    per_token = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()
    f = torch.cat(run_steps(exact, ids, 6), 1).float()
    noise = ((b - f).norm(dim=-1) / f.norm(dim=-1)).flatten()
    assert float(noise.max()) > 0  # a float32 reference (a bf16 one would match torch_ref exactly)
    assert_within_bounds_but_for_ties(per_token, torch.clamp(2 * noise, min=TOL))
    return [rel(x, y) for x, y in zip(got, want, strict=True)], want


@gpu
@pytest.mark.parametrize("defer", [None, 1])
@pytest.mark.parametrize("case", FAMILIES)
def test_hybrid_graph_matches_torch_ref_on_the_same_plan(case, defer, tiny_dirs):
    """cuda_graph against torch_ref on the same bf16 plan (`assert_matches_torch_ref`). The plan
    is the same on every card (its VRAM budget is fixed by the model); which tokens sit at a near
    tie is not: it depends on the bf16 kernels. glm4_moe's run on an H200 was 0.056 off as a
    whole, the size one tied token 0.33 off makes in a run of 36, and failed a bound of 0.05 on
    the whole run."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = hybrid(model, defer=defer, backend="cuda_graph")
    g = c.decode.ir
    cpu_experts = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu"]
    assert cpu_experts and any(n.op == Op.SYNC for n in g.nodes) and g.by_name("L0.attn").place.device.value == "gpu"
    assert (defer is not None) == any(n.name.endswith(".def") for n in g.nodes)
    errs, want = assert_matches_torch_ref(c, model, defer)
    runner = c.executor("decode").runner
    assert runner is not None and runner.bound[2].graph is not None  # decode steps 2.. replayed the graph
    nat = ktflow.Compiled(c.plans.model_copy(update={"options": c.plans.options.model_copy(
        update={"backend": "native"})}), model)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = run_steps(nat, ids, 6)
    print(f"\n  {case} defer={defer}: per step relative error vs torch_ref {[f'{e:.4f}' for e in errs]}, "
          f"native eager vs torch_ref {[f'{rel(a, b):.4f}' for a, b in zip(eager, want, strict=True)]}")


@pytest.mark.skipif(not native.available(), reason="needs the native module")
@pytest.mark.parametrize("case,defer", [*((f, None) for f in FAMILIES), ("qwen3_moe", 1), ("deepseek_v3", 1)])
def test_hybrid_plan_on_the_native_backend_matches_torch_ref_on_the_cpu(case, defer, tiny_dirs):
    """The same comparison where no GPU is needed (device='cpu' runs the hybrid plan on the CPU):
    the native backend's CPU experts and split layers against torch_ref. deepseek_v3's run here
    has a near tie (a token 0.29 off on this comparison, on an AMD EPYC host)."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    assert_matches_torch_ref(hybrid(model, device="cpu", defer=defer, backend="native"), model, defer)


@gpu
@pytest.mark.parametrize("defer", [None, 2])
def test_graph_replay_equals_eager_issue_of_the_same_step(defer, tiny_dirs):
    d, _ = tiny_dirs("deepseek_v3")
    model = ktflow.load(d)
    graph, eager = hybrid(model, defer=defer), hybrid(model, defer=defer)
    eager.executor("decode").runner.capture = False
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    a, b = run_steps(graph, ids, 5), run_steps(eager, ids, 5)
    assert graph.executor("decode").runner.bound[2].graph is not None
    assert eager.executor("decode").runner.bound[2].graph is None
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= 1e-3 * y.abs().max()


@gpu
def test_both_waits_give_the_same_steps(tiny_dirs):
    """A captured sync as a wait on the task's done flag (the default where the driver has
    stream memory operations) and as a blocking host node: the same logits, deferral included."""
    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    flag, host = hybrid(model, defer=1), hybrid(model, defer=1)
    assert flag.executor("decode").runner.be.wait == "flag"  # what the GPU machine's driver supports
    host.executor("decode").runner.be.wait = "host"
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    a, b = run_steps(flag, ids, 5), run_steps(host, ids, 5)
    assert host.executor("decode").runner.bound[2].graph is not None
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= 1e-3 * y.abs().max()


@gpu
@pytest.mark.parametrize("case,options", [("qwen3_moe", dict(defer=1)), ("deepseek_v3", dict(defer=1, numa_nodes=2)),
                                          ("deepseek_v2_lite", {})])
def test_doorbell_submits_give_the_same_steps_as_host_nodes(case, options, tiny_dirs):
    """submit='doorbell' (the stream writes each batch's doorbell, the armed dispatcher polls them;
    deferral and NUMA shards, two batches per task, included) against host-node submits: the same
    logits, and no host function in the replayed steps."""
    from torch.profiler import ProfilerActivity, profile

    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    bell, host = hybrid(model, **options), hybrid(model, **options)
    assert bell.executor("decode").runner.be.submit == "doorbell"  # the default where the driver has write-value
    host.executor("decode").runner.be.submit = "host"
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    a, b = run_steps(bell, ids, 5), run_steps(host, ids, 5)
    runner = bell.executor("decode").runner
    assert runner.bound[2].graph is not None and runner.bound[2].ring is not None
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= 1e-3 * y.abs().max()
    logits, state = ktflow.execute(bell, ids)  # no host function left in a replayed step
    nxt = logits[:, -1:].argmax(-1)
    for _ in range(2):
        logits, state = ktflow.execute(bell, nxt, state)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            logits, state = ktflow.execute(bell, nxt, state)
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 3 and "cuLaunchHostFunc" not in names


OTHER_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cuLaunchHostFunc")


@gpu
def test_one_graph_launch_per_decoded_token(demo_dir):
    """Greedy steps (logits='argmax'): one graph launch a token and nothing else launched; a step
    asked for its logits adds only their copy back."""
    from torch.profiler import ProfilerActivity, profile

    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw=hw_here(), device="cuda", vram_budget_gb=0.01, defer=1, max_seq_len=64)
    assert any(n.op == Op.SUBMIT for n in c.decode.ir.nodes)
    ids = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(0))
    _, state = ktflow.execute(c, ids)
    for t in range(2):  # eager + capture, then a first replay
        _, state = ktflow.execute(c, torch.tensor([[t + 1]]), state)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for t in range(4):
            _, state = ktflow.execute(c, torch.tensor([[t + 5]]), state, logits="argmax")
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 4
    assert not [n for n in names if n in OTHER_LAUNCHES]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for t in range(4):
            _, state = ktflow.execute(c, torch.tensor([[t + 5]]), state)
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 4 and names.count("cudaMemcpyAsync") == 4  # the logits


@gpu
def test_out_of_memory_at_capture_names_the_node_and_the_prediction(demo_dir, monkeypatch):
    from ktflow.backends.cuda.backend import DecodeGraph

    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw=hw_here(), device="cuda", vram_budget_gb=0.01, max_seq_len=64)
    issue = DecodeGraph._issue

    def failing(self, bound, state, timer, steps=1):
        if torch.cuda.is_current_stream_capturing():
            self.current = "L2.attn"
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return issue(self, bound, state, timer, steps)

    monkeypatch.setattr(DecodeGraph, "_issue", failing)
    _, state = ktflow.execute(c, torch.tensor([[1, 2, 3]]))
    with pytest.raises(KtflowError, match=r"capturing the decode step for batch 1, at L2\.attn.*predicted a peak"):
        ktflow.execute(c, torch.tensor([[4]]), state)


@gpu
def test_a_plan_for_another_gpu_memory_size_is_refused(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", device="cuda", max_seq_len=64)  # an A100 40GB
    here = torch.cuda.get_device_properties(0).total_memory / 2**30
    if abs(here - 40) < 2:
        pytest.skip("this GPU has the A100's 40 GB")
    with pytest.raises(PlanError, match=r"GPU with 40\.0 GiB.*has \d+\.\d GiB.*--hw this"):
        ktflow.execute(c, torch.tensor([[1, 2]]))


# --------------------------------------------------------------------------- any machine


def _cuda_plan(demo_dir):
    """A plan as if compiled where GPU nodes run on CUDA (the device field is what matters)."""
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", device="cpu", max_seq_len=64)
    cuda = lambda p: p.model_copy(update={"device": "cuda"})  # noqa: E731
    plans = c.plans.model_copy(update={"prefill": [cuda(p) for p in c.prefill], "decode": cuda(c.decode)})
    return ktflow.Compiled(plans, c.model)


def test_a_gpu_plan_without_a_gpu_says_how_to_compile_for_this_machine(demo_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = _cuda_plan(demo_dir)
    with pytest.raises(PlanError, match=r"torch sees no CUDA device.*--hw this"):
        ktflow.execute(c, torch.tensor([[1, 2]]))


def test_gpu_memory_size_check(demo_dir, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "a test GPU")
    c = _cuda_plan(demo_dir)
    planned = c.plans.hw.gpus[0].memory_bytes
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=int(planned * 2)))
    with pytest.raises(PlanError, match=r"GPU with 40\.0 GiB of memory .*a test GPU\) has 80\.0 GiB"):
        c.executor("prefill")
    from ktflow.runtime.compiled import check_gpu

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=int(planned * 1.01)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(planned), int(planned)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=0: 0)
    check_gpu(c.plans)  # within the tolerance: the same GPU as reported by another driver
    # another process holds nearly all of it: refused before anything is allocated, with the numbers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (1000, int(planned)))
    with pytest.raises(ResourceError, match=r"needs [\d.]+ GB of GPU memory; 0\.0 GB of [\d.]+ GB are free"):
        check_gpu(c.plans)


@gpu
def test_a_plan_for_this_machine_captures_replays_and_traces(demo_dir):
    """This machine's profile with a small budget: the token ids reach the GPU through the copy
    lane with no GPU event before them (the copy stream must still be part of the capture)."""
    c = ktflow.compile(ktflow.load(demo_dir), hw=None, device="cuda", vram_budget_gb=0.01, max_seq_len=64)
    assert any(n.op == Op.SUBMIT for n in c.decode.ir.nodes)
    c.executor("decode").trace = 1
    out = ktflow.generate(c, torch.tensor([[1, 2, 3, 4]]), 6, eos_token_id=None)  # all six steps
    assert out.shape == (1, 10)
    assert c.executor("decode").runner.bound[1].graph is not None
    measured = c.executor("decode").measured
    assert measured and [s.node for s in measured] == [s.node for s in c.decode.instructions]
    # the host's time issuing each instruction, beside the lanes' measured times
    assert all(s.issue_us is not None and s.issue_us >= 0 for s in measured if s.kind not in ("record", "wait"))
    assert all(s.issue_us is None for s in c.decode.instructions)  # a compiled plan has none


def test_a_tie_excuses_a_token_a_broken_one_is_not_excused():
    """compare.assert_within_bounds_but_for_ties, the GPU comparisons' check: one token off by
    what a router tie does passes however short the run; a token off by what a lost or wrong step
    gives, or more than FLIPS of the tokens off, does not."""
    from compare import FLIP_CEIL, assert_within_bounds_but_for_ties

    err = torch.full((36,), 0.01)
    assert_within_bounds_but_for_ties(err, TOL)
    err[20] = 0.6  # a group flip's size: 0.1 off as a whole run of 36, which a whole-run bound refused
    assert_within_bounds_but_for_ties(err, TOL)
    assert_within_bounds_but_for_ties(err, torch.full((36,), TOL))
    for bad in (1.0, FLIP_CEIL + 0.01):  # logits lost, or just beyond any measured tie
        worse = err.clone()
        worse[20] = bad
        with pytest.raises(AssertionError, match="more than a router tie"):
            assert_within_bounds_but_for_ties(worse, TOL)
    err[:4] = 0.05  # 5 of 36 tokens off
    with pytest.raises(AssertionError, match="5 of 36 tokens above their bound"):
        assert_within_bounds_but_for_ties(err, TOL)


def test_the_runners_bindings_take_what_their_bind_gives_them():
    """Runs without a GPU: the decode and prefill bindings are built from the keywords their
    `_bind` passes (a binding that lost its dataclass, or a keyword its class lacks, would fail
    only on a GPU, at the first step)."""
    import ast
    import inspect
    import textwrap

    from ktflow.backends.cuda.decode import Bound, DecodeGraph
    from ktflow.backends.cuda.prefill import PrefillBound, PrefillRunner

    for cls, runner in ((Bound, DecodeGraph), (PrefillBound, PrefillRunner)):
        tree = ast.parse(textwrap.dedent(inspect.getsource(runner._bind)))
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == cls.__name__]
        assert len(calls) == 1, cls.__name__
        made = cls(**{k.arg: None for k in calls[0].keywords})
        assert all(getattr(made, k.arg) is None for k in calls[0].keywords)


def test_what_the_cuda_runners_read_off_their_backend_it_has():
    """Runs without a GPU: every attribute the CUDA runners and the driver read off their backend
    (`be.X`, `self.be.X`, `be.experts.X`) is one the composed CudaGraphBackend has (a method, a
    property, or set in its __init__; the experts' on NativeExperts; the static rules' `be` is the
    reference engine they are composed into): a renamed or moved part would otherwise fail only on
    a GPU."""
    import ast
    import inspect
    import textwrap
    from pathlib import Path

    from ktflow.backends.cuda import backend as cuda_backend
    from ktflow.backends.native.experts import NativeExperts
    from ktflow.backends.torch_ref import TorchRefBackend

    def members(cls) -> set[str]:  # its own and its bases' (a native backend's, for the CUDA one)
        assigned = set()
        for c in cls.__mro__[:-1]:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
            assigned |= {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                         for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        return assigned | {n for n in dir(cls) if not n.startswith("__")}

    has = {"be": members(cuda_backend.CudaGraphBackend), "experts": members(NativeExperts),
           "engine": members(TorchRefBackend)}
    read: set[tuple[str, str, str]] = set()
    for path in Path(cuda_backend.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if isinstance(owner, ast.Attribute) and owner.attr == "experts" and (
                    isinstance(owner.value, ast.Name) and owner.value.id == "be" or
                    isinstance(owner.value, ast.Attribute) and owner.value.attr == "be"):
                read.add(("experts", node.attr, path.name))
            elif isinstance(owner, ast.Name) and owner.id == "be" or \
                    isinstance(owner, ast.Attribute) and owner.attr == "be" and isinstance(owner.value, ast.Name):
                read.add(("engine" if path.name == "static_rules.py" else "be", node.attr, path.name))
    assert len(read) > 10  # the scan sees the runners' reads
    missing = sorted(r for r in read if r[1] not in has[r[0]])
    assert not missing, missing
