"""The decode-time GPU expert cache (runtime/expert_cache.py): a split layer's GPU experts refilled
in place give the no-cache plan's logits (within bf16 rounding: an expert moved between the
devices is computed by the other device's kernel), the refill follows recorded routing, and bad
requests are one clear error."""

import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import ktflow
from ktflow.errors import ConfigError, InputError
from ktflow.costmodel.hw import PRESETS, resolve_hw, with_this_gpus_memory
from ktflow.ir.ops import Op
from ktflow.ir.printer import print_graph
from ktflow.backends.native.binding import available as native_available
from ktflow.runtime.expert_cache import ExpertCache
from ktflow.runtime.routing import RoutingRecorder

pytestmark = pytest.mark.skipif(not native_available(), reason="needs the native module")

PROMPT = torch.tensor([[5, 17, 3, 9, 44, 2]])

#: the desktop preset with launches at a tenth of a microsecond: at the demo model's tiny sizes the
#: grouped rule's ~25 launches would outweigh the work in every prefill choice; the tests of what a
#: cached layer's prefill does as its work grows use it
LIGHT = PRESETS["rtx4090-desktop"].model_copy(
    update={"overheads": PRESETS["rtx4090-desktop"].overheads.model_copy(update={"gpu_launch_us": 0.1})})


def split_options(model, device="cpu", backend="native", hw="rtx4090-desktop", **extra):
    """Compile options whose decode plan splits some layer's experts between the GPU and the CPU
    (with `extra` options, which the returned ones include), for profile `hw`."""
    for budget in (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2):
        kw = dict(hw=hw if device == "cpu" else with_this_gpus_memory(resolve_hw(hw)),
                  device=device, vram_budget_gb=budget, allow_oversize=True, backend=backend,
                  max_seq_len=64, **extra)
        c = ktflow.compile(model, expert_cache=True, **kw)
        if any(n.op == Op.ROUTED_EXPERTS and n.attrs.cached for n in c.decode.ir.nodes):
            return kw
    raise AssertionError("no budget split a layer's experts")


def cached_node(c):
    return next(n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached)


def decode_logits(c, refill=None, steps=4, later=None):
    """The prompt's last logits and `steps` greedy decode steps' logits; refill() runs before the
    second decode step, later() before the fourth."""
    logits, state = ktflow.execute(c, PROMPT)
    out = [logits[:, -1]]
    nxt = logits[:, -1:].argmax(-1)
    for i in range(steps):
        if refill is not None and i == 1:
            refill()
        if later is not None and i == 3:
            later()
        logits, state = ktflow.execute(c, nxt, state)
        out.append(logits[:, -1])
        nxt = logits[:, -1:].argmax(-1)
    return torch.stack(out).float()


def amplified(src, dst, factor=30.0):
    """The checkpoint with every routed expert's down projection `factor` times larger: the experts
    then dominate the logits, so an expert computed twice or not at all shows far above rounding."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        for k in t:
            if ".mlp.experts." in k and k.endswith("down_proj.weight"):
                t[k] = (t[k].float() * factor).to(t[k].dtype)
        save_file(t, f, metadata={"format": "pt"})
    return dst


def broken_stage(*args, **kwargs):
    """A stager's stage that fails, as a device copy would."""
    raise OSError("device copy failed")


def assert_each_expert_computed_once(cache):
    """Every expert of every cached layer, in every plan's CPU part: either in a GPU row that holds
    it (the map names the row) or on that CPU part's mask, never both, never neither."""
    for c in cache.layers.values():
        for _, stacked in c.stacks:
            local = stacked["local"].cpu()
            for e in range(c.experts):
                if local[e] >= 0:
                    assert c.resident[int(local[e])] == e
                for mask, own in c.masks:
                    if e in own:
                        assert bool(mask[e]) != bool(local[e] >= 0), f"layer {c.layer} expert {e}"


def rows_hold_their_experts(c, cache):
    """Every filled row of every cached layer holds its expert's checkpoint weights (rounded to the
    stack's dtype)."""
    weights = c.model.weights
    for cl in cache.layers.values():
        for node, stacked in cl.stacks:
            lo, hi = node.attrs.rows
            refs = {r.role: r for r in node.weights if r.experts}
            for row, e in enumerate(cl.resident):
                if e < 0:
                    continue
                assert int(stacked["local"][e]) == row
                for role in ("gate", "up", "down"):
                    want = weights.load_expert(refs[role], e)
                    want = want[:, lo:hi] if role == "down" else want[lo:hi]
                    assert torch.equal(stacked[role][row].cpu(), want.to(stacked[role].dtype)), (e, role)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device,stage", [("cpu", 1), pytest.param("cuda", 1, marks=CUDA),
                                          pytest.param("cuda", None, marks=CUDA)])
def test_refilled_rows_hold_their_experts_weights(demo_dir, device, stage, monkeypatch, capsys):
    """A refill's copies (from the CPU side's packed experts, unpacked on the device, a bounded
    number of experts at a time: one, or as many as STAGE_BYTES holds) put each expert's own
    weights in its row. On CUDA the copies wait behind a busy copy stream while the host goes on
    allocating and writing device memory of the row index's size, which must not reach the
    copies."""
    import ktflow.runtime.expert_cache as expert_cache

    if stage is not None:
        monkeypatch.setattr(expert_cache, "STAGE_BYTES", stage)
    model = ktflow.load(demo_dir)
    kw = split_options(model, device=device, backend="cuda_graph" if device == "cuda" else "native")
    c = ktflow.compile(model, expert_cache=True, **kw)
    cache = ExpertCache(c)
    n = cached_node(c)
    outside = [e for e in range(n.attrs.experts) if e not in n.attrs.ids][:len(n.attrs.ids)]
    def allocations():  # device memory of the index's size, made and freed on the current stream
        for _ in range(64):
            torch.full((len(outside),), 10 ** 6, dtype=torch.int64, device="cuda").add_(1)

    if device == "cuda":
        # every kernel this test runs loaded first (a refill there and back, the allocations): CUDA
        # loads a kernel at its first launch, and loading one may wait for the whole device (the sleep)
        cache.refill(n.attrs.layer, outside)
        cache.refill(n.attrs.layer, n.attrs.ids)
        allocations()
        torch.cuda.synchronize()
        with torch.cuda.stream(cache.copy_stream):
            torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clocks
    t0 = time.perf_counter()
    assert cache.refill(n.attrs.layer, outside, wait=False) == len(outside)
    took = time.perf_counter() - t0
    if device == "cuda":
        allocations()
        # the copies still behind the sleep (else the host waited for them: how long, and why, said:
        # copies from memory the driver did not page-lock hold the host)
        from ktflow.backends.native.staging import pin

        pinned = [pin(piece.op) for piece in cache.stagers[n.attrs.layer].pieces]
        assert cache.pending and not cache.pending[0][3].query(), \
            (f"refill took {took:.3f} s on the host, {time.perf_counter() - t0:.3f} s with the allocations; the "
             f"CPU experts page-locked: {pinned}; messages: {capsys.readouterr().err[-500:]!r}")
    cache.poll(wait=True)
    assert sorted(cache.resident(n.attrs.layer)) == sorted(outside)
    rows_hold_their_experts(c, cache)
    assert_each_expert_computed_once(cache)


def test_refilled_cache_gives_the_no_cache_plans_logits(demo_dir, tmp_path):
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model, prefill_experts="cpu")  # both prefills the same arithmetic: every CPU expert there
    ref = decode_logits(ktflow.compile(model, **kw))
    c = ktflow.compile(model, expert_cache=True, **kw)
    n = cached_node(c)
    assert "a cache the runtime refills" in n.place.cause and "refill_every=32" in print_graph(c.decode.ir)
    layer, first = n.attrs.layer, n.attrs.ids
    outside = [e for e in range(n.attrs.experts) if e not in first][:len(first)]
    cache = ExpertCache(c)
    copied = []
    got = decode_logits(c, lambda: copied.append(cache.refill(layer, outside)))
    assert copied == [len(outside)] and cache.resident(layer) == tuple(sorted(outside))
    assert torch.equal(got[:2], ref[:2])  # before the refill: the same arithmetic
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 0.01 * scale  # after it: the moved experts' other kernel (bf16 rounding)
    # the check can fail: a row's expert also computed on the CPU (its mask bit left on) is counted twice
    cache.layers[layer].masks[0][0][outside[0]] = 1
    wrong = decode_logits(c)
    assert (wrong - ref).abs().max() > 0.05 * scale


def test_a_refill_that_does_not_wait_moves_experts_to_the_cpu_first(demo_dir, tmp_path):
    """refill(wait=False) empties the outgoing rows at once (their experts computed on the CPU
    from the next step), copies behind the steps, and poll() puts the incoming experts on the GPU:
    every step in between computes each expert exactly once."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model)
    ref = decode_logits(ktflow.compile(model, prefill_experts="cpu", **kw), steps=5)
    c = ktflow.compile(model, expert_cache=True, **kw)
    n = cached_node(c)
    layer, first = n.attrs.layer, n.attrs.ids
    outside = [e for e in range(n.attrs.experts) if e not in first][:len(first)]
    cache = ExpertCache(c)
    seen = {}

    def begin():
        cache.refill(layer, outside, wait=False)
        seen["during"] = cache.layers[layer].resident.copy()
        mask = cache.layers[layer].masks[0][0]
        seen["cpu"] = {e for e in range(n.attrs.experts) if mask[e]}

    got = decode_logits(c, begin, steps=5, later=lambda: seen.setdefault("finished", cache.poll()))
    assert seen["during"] == [-1] * len(first)  # every row emptied, its copy under way
    assert seen["cpu"] == set(range(n.attrs.experts))  # meanwhile the CPU computes the whole layer
    assert seen["finished"] == len(outside) and cache.resident(layer) == tuple(sorted(outside))
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()


@pytest.mark.parametrize("numa", ["tp", "ep"])
def test_a_refill_over_numa_shards_computes_each_expert_once(numa, demo_dir, tmp_path):
    """Two NUMA shards: by rows (tp) each computes every CPU expert's half, by experts (ep) each
    its own experts; an expert the cache gives up goes to every row shard, or to exactly one
    expert shard (reduced over the shards, it would otherwise count twice)."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = dict(split_options(model), numa=numa, numa_nodes=2)
    ref = decode_logits(ktflow.compile(model, prefill_experts="cpu", **kw))  # prefill as the cached plan runs it
    c = ktflow.compile(model, expert_cache=True, **kw)
    n = cached_node(c)
    cpu_parts = [m for m in c.decode.ir.nodes if m.op == Op.ROUTED_EXPERTS and m.attrs.layer == n.attrs.layer
                 and m.place.device.value == "cpu"]
    assert len(cpu_parts) == 2
    outside = [e for e in range(n.attrs.experts) if e not in n.attrs.ids][:len(n.attrs.ids)]
    cache = ExpertCache(c)
    got = decode_logits(c, lambda: cache.refill(n.attrs.layer, outside))
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    masks = [m for m, _ in cache.layers[n.attrs.layer].masks]
    computed = sum(m.long() for m in masks)  # per expert: how many shards compute it
    assert all(int(computed[e]) == 0 for e in outside)
    want = len(masks) if numa == "tp" else 1
    assert all(int(computed[e]) == want for e in range(n.attrs.experts) if e not in outside)


def test_following_the_routing_refills_between_steps_and_keeps_the_logits(demo_dir, tmp_path):
    """follow(every=2): a refill after the prompt's prefill step and after every 2 decoded
    tokens, each from the picks since the last (the counters zeroed in place); the logits stay
    the no-cache plan's within bf16 rounding; stop() takes the recorder and the hook off."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model)
    ref = decode_logits(ktflow.compile(model, prefill_experts="cpu", **kw))  # prefill as the cached plan runs it
    c = ktflow.compile(model, expert_cache=True, **kw)
    cache = ExpertCache(c)
    n = cached_node(c)
    rec = cache.follow(every=2)
    got = decode_logits(c)  # a prefill step, then 4 decode steps
    assert cache.refills == 1 + 2
    assert int(rec.rows[n.attrs.layer]) == 0  # zeroed at the last refill
    # the hit statistics: decoded picks only (at most 4 tokens, k picks each, per cached layer: a layer
    # whose copies were still under way at a step's end counts its window at a later refill)
    k = n.attrs.top_k
    assert 0 < cache.served <= cache.picked <= 4 * k * len(cache.layers) and cache.picked % k == 0
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    cache.stop()
    assert all(c.executor(p).recorder is None and not c.executor(p).after_run for p in (c.decode, *c.prefill))
    with pytest.raises(InputError, match="every"):
        cache.follow(every=0)


def test_a_ragged_batchs_padding_rows_do_not_count_toward_the_refill_interval(demo_dir):
    """In a SlotPool step only the listed rows are decoded tokens: one sequence in a bucket of 4
    rows refills every 3 of its own tokens, not after every step's 4 rows."""
    from ktflow.runtime.slots import SlotPool

    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **dict(split_options(model), max_batch=4))
    assert any(n.op == Op.ROUTED_EXPERTS and n.attrs.cached for n in c.decode.ir.nodes)
    cache = ExpertCache(c)
    cache.follow(every=3)
    pool = SlotPool(c, 4)
    pool.start(2)
    pool.prefill(2, PROMPT)
    assert cache.refills == 1  # after the prompt
    nxt = 9
    for _ in range(2):
        assert pool.bucket(3) == 4  # rows 0, 1 and 3 are padding
        nxt = int(pool.decode([2], [nxt], logits="argmax")[0])
    assert cache.refills == 1 and set(cache.since.values()) == {2}
    pool.decode([2], [nxt])
    assert cache.refills == 2
    cache.stop()


def test_a_cached_layers_prefill_streams_the_layer_whole_or_keeps_it(demo_dir):
    """place_prefill_experts streams a split layer's CPU experts for a long prompt; a cached layer
    it streams whole (one GPU node over every expert, from a fetch of them all, standing in for the
    cache part, whose rows the plan still counts in VRAM) or keeps as placed: never a subset,
    which the runtime's refills would contradict."""
    model = ktflow.load(demo_dir)
    kw = split_options(model, hw=LIGHT)
    layer = cached_node(ktflow.compile(model, expert_cache=True, **kw)).attrs.layer

    def layer_nodes(p):
        return [n for n in p.ir.nodes if n.op in (Op.FETCH, Op.ROUTED_EXPERTS) and n.attrs.layer == layer]

    plain = ktflow.compile(model, **kw)
    assert any(n.op == Op.FETCH for p in plain.prefill for n in layer_nodes(p))  # streamed without the cache
    c = ktflow.compile(model, expert_cache=True, prefill_experts="stream", **kw)
    rows = len(cached_node(c).attrs.ids)
    for p in c.prefill:
        fetch, experts = ([n for n in layer_nodes(p) if n.op == op] for op in (Op.FETCH, Op.ROUTED_EXPERTS))
        assert [len(f.attrs.ids) for f in fetch] == [fetch[0].attrs.experts]  # every expert of the layer
        (whole,) = experts  # the cache part and the CPU part replaced by one streamed node
        assert whole.place.device.value == "gpu" and whole.attrs.ids == tuple(range(whole.attrs.experts))
        assert whole.attrs.cache_size == rows and not whole.attrs.cached
        assert "a cache of" in whole.place.cause
    # the rows still resident: the plan's VRAM is the kept plan's and the staging (the weights the same)
    for p, kept in zip(c.prefill, ktflow.compile(model, expert_cache=True, prefill_experts="cpu", **kw).prefill):
        assert p.memory.weight_bytes == pytest.approx(kept.memory.weight_bytes, rel=1e-9)
        assert p.memory.staging_bytes > 0 and p.memory.gpu_bytes - p.memory.staging_bytes == \
            pytest.approx(kept.memory.gpu_bytes, rel=1e-9)
    auto = ktflow.compile(model, expert_cache=True, **kw)  # auto: each prefill plan streams whole or keeps
    for p in auto.prefill:
        parts = layer_nodes(p)
        fetch = [n for n in parts if n.op == Op.FETCH]
        assert not fetch or len(fetch[0].attrs.ids) == fetch[0].attrs.experts
        assert bool(fetch) != any(n.attrs.cached for n in parts)
    with pytest.raises(ConfigError, match="expert_cache"):
        ktflow.compile(model, expert_cache=True, prefill_experts="split", **kw)


def test_the_pass_streams_a_cached_layer_whole_for_a_long_prompt_only(demo_dir):
    """auto: a prefill of 64 tokens keeps the cached layer as placed (the resident rows do part
    of the work, the rest is little CPU work), one of 1024 streams it whole (the CPU part's work
    grows with the tokens, the fetch does not); each cause says which and why."""
    model = ktflow.load(demo_dir)
    kw = split_options(model, hw=LIGHT)
    layer = cached_node(ktflow.compile(model, expert_cache=True, **kw)).attrs.layer

    def whole(p):
        return [n for n in p.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == layer and n.attrs.cache_size]

    short, long = (ktflow.compile(model, expert_cache=True, **dict(kw, max_seq_len=m)).prefill_plan(m) for m in (64, 1024))
    assert (short.step_tokens, long.step_tokens) == (64, 1024)
    assert not whole(short) and whole(long)
    kept = next(n for n in short.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == layer
                and n.place.device.value == "cpu")
    assert "streamed whole or kept): cpu (fastest" in kept.place.cause
    assert "stream 32/32 experts" in whole(long)[0].place.cause


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_a_prefill_fetch_copies_from_the_decode_plans_packed_experts(demo_dir, first):
    """A prefill step that streams a cached layer whole, run before any decode step, finds the
    decode plan's CPU experts packed (here NUMA row shards) and copies from them: the layer's
    experts are packed once whichever plan runs first."""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model, prefill_experts="stream", numa_nodes=2,
                                                                  numa="tp"))
    if first == "prefill":
        ktflow.execute(c, PROMPT)
    ExpertCache(c)  # every plan prepared
    layer = cached_node(c).attrs.layer
    packs = [key for key in c._backend.experts._packed if key[1] == tuple(range(cached_node(c).attrs.experts))]
    assert sorted(key[2] for key in packs) == sorted({n.attrs.rows for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS
                                                      and n.attrs.layer == layer and n.place.device.value == "cpu"})


def test_a_plan_streaming_a_cached_layer_whole_saves_loads_and_is_checked(demo_dir, tmp_path):
    """The plan file round-trips (its cache_size node is one the placement passes make, not an
    edit); a cache_size on a node that does not stream every expert is refused by rule S1."""
    from dataclasses import replace

    from ktflow.runtime.compiled import Compiled
    from ktflow.ir.verify import VerifyError, verify

    model = ktflow.load(demo_dir)
    kw = split_options(model)
    c = ktflow.compile(model, expert_cache=True, prefill_experts="stream", **kw)
    c.save(tmp_path / "plan.json")
    back = Compiled.load(tmp_path / "plan.json", model)
    g = back.prefill[0].ir
    n = next(m for m in g.nodes if m.op == Op.ROUTED_EXPERTS and m.attrs.cache_size)
    assert n.attrs == next(m for m in c.prefill[0].ir.nodes if m.name == n.name).attrs
    verify(g, "placed")
    bad = g.replace_nodes([replace(m, attrs=replace(m.attrs, cache_size=m.attrs.experts)) if m.name == n.name else m
                           for m in g.nodes])  # as many rows as experts: no cache
    with pytest.raises(VerifyError, match="cache_size"):
        verify(bad, "placed")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_prefill_streaming_a_cached_layer_whole_keeps_the_logits_and_the_cache(demo_dir, tmp_path, device):
    """With the cached layer streamed whole in prefill (every expert once, on the GPU lane) the
    prompt's logits are the no-cache plan's streamed prefill's, and the decode steps after the
    cache's refill from the prompt the no-cache plan's too (bf16 rounding: the amplified experts
    show an expert computed twice or missed); the cache refilled from the prompt's picks."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model, device=device, backend="cuda_graph" if device == "cuda" else "native",
                       prefill_experts="stream")
    ref = decode_logits(ktflow.compile(model, **kw))
    c = ktflow.compile(model, expert_cache=True, **kw)
    n = cached_node(c)
    assert all(m.attrs.cache_size for p in c.prefill for m in p.ir.nodes
               if m.op == Op.ROUTED_EXPERTS and m.attrs.layer == n.attrs.layer)
    cache = ExpertCache(c)
    cache.follow(every=2)
    got = decode_logits(c)
    assert cache.refills == 1 + 2 and cache.copied > 0  # after the prompt, then every 2 decoded tokens
    scale = ref.abs().max()
    assert (got[0] - ref[0]).abs().max() <= 0.01 * scale  # the prompt: every expert once
    assert (got - ref).abs().max() <= 0.01 * scale
    cache.stop()


def test_the_plan_counts_the_cpu_copy_of_cached_experts(demo_dir):
    """A cached layer's CPU part packs every expert of the layer: the plan's host memory says so."""
    model = ktflow.load(demo_dir)
    kw = split_options(model)
    plain, cached = ktflow.compile(model, **kw).decode, ktflow.compile(model, expert_cache=True, **kw).decode
    n = cached_node(ktflow.compile(model, expert_cache=True, **kw))
    cpu = next(m for m in cached.ir.nodes if m.op == Op.ROUTED_EXPERTS and m.attrs.layer == n.attrs.layer
               and m.place.device.value == "cpu")
    per_expert = cpu.weight_elems() / len(cpu.attrs.ids) * 2  # bf16 experts
    extra = cached.memory.host_bytes - plain.memory.host_bytes
    assert extra == pytest.approx(len(n.attrs.ids) * per_expert, rel=0.02)


def test_the_cache_refills_with_the_most_recorded_experts(demo_dir):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model))
    n = cached_node(c)
    rec = RoutingRecorder()
    picks = torch.tensor([[e, (e + 1) % n.attrs.experts] for e in range(n.attrs.experts - 1, 0, -1)] * 3)
    rec.add(n.attrs.layer, picks, n.attrs.experts)
    counts = rec.counts[n.attrs.layer].tolist()
    cache = ExpertCache(c)
    cache.refill_from(rec)
    rows = len(n.attrs.ids)
    want = sorted(range(n.attrs.experts), key=lambda e: (-counts[e], e))[:rows]
    assert cache.resident(n.attrs.layer) == tuple(sorted(want))
    assert cache.refill_from(rec) == {n.attrs.layer: 0}  # already resident: nothing copied


def test_bad_cache_requests_are_one_error(demo_dir):
    model = ktflow.load(demo_dir)
    kw = split_options(model)
    with pytest.raises(ConfigError, match="expert_cache=True"):
        ExpertCache(ktflow.compile(model, **kw))
    c = ktflow.compile(model, expert_cache=True, **kw)
    cache = ExpertCache(c)
    n = cached_node(c)
    with pytest.raises(InputError, match="rows"):
        cache.refill(n.attrs.layer, [0])
    with pytest.raises(InputError, match="rows"):
        cache.refill(n.attrs.layer, [0] * len(n.attrs.ids))
    with pytest.raises(InputError, match="no expert cache"):
        cache.refill(-1, [0])
    with pytest.raises(ConfigError, match="mask"):
        ExpertCache(ktflow.compile(model, expert_cache=True, **dict(kw, backend="torch_ref")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_decode_graph_computes_the_refilled_split(demo_dir):
    """The refill rewrites the stacked weights, the expert map and the CPU masks in place, so a
    decode step captured before it, replayed after it, gives what the same plan issued eagerly
    gives after the same refill."""
    model = ktflow.load(demo_dir)
    kw = split_options(model, device="cuda", backend="cuda_graph")

    def run(capture: bool, wait: bool):
        c = ktflow.compile(model, expert_cache=True, **kw)
        c.executor(c.decode).runner.capture = capture
        n = cached_node(c)
        outside = [e for e in range(n.attrs.experts) if e not in n.attrs.ids][:len(n.attrs.ids)]
        cache = ExpertCache(c)
        return decode_logits(c, lambda: cache.refill(n.attrs.layer, outside, wait=wait), steps=5,
                             later=lambda: cache.poll(wait=True))

    for wait in (True, False):  # copies on the cache's own stream, taken in two steps later
        replayed, eager = run(True, wait), run(False, wait)
        assert torch.equal(replayed, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_steps_run_while_refill_copies_are_under_way(demo_dir, tmp_path, monkeypatch):
    """follow()'s refills issue their copies on the cache's own stream and return: decode steps
    (the first one captured, later ones replayed) run while the copies are still under way, and
    the decoded logits are the no-cache plan's within bf16 rounding. The copy stream is held busy
    before each refill's copies so that they overlap the steps."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model, device="cuda", backend="cuda_graph")
    ref = decode_logits(ktflow.compile(model, prefill_experts="cpu", **kw))
    c = ktflow.compile(model, expert_cache=True, **kw)
    cache = ExpertCache(c)
    copy = cache._copy

    def slow_copy(*args):
        with torch.cuda.stream(cache.copy_stream):
            torch.cuda._sleep(50_000_000)  # some tens of milliseconds of GPU clocks
        copy(*args)

    monkeypatch.setattr(cache, "_copy", slow_copy)
    under_way = []  # at each step's end: whether some copy had not landed yet
    ex = c.executor(c.decode)
    ex.after_run.insert(0, lambda *_: under_way.append(any(j[3] is not None and not j[3].query()
                                                           for j in cache.pending)))
    cache.follow(every=2)
    got = decode_logits(c)
    cache.stop()
    assert cache.copied > 0 and any(under_way)
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()


def test_ktflow_run_follows_the_routing_with_expert_cache(demo_dir, capsys):
    from ktflow.tools.cli import main

    kw = split_options(ktflow.load(demo_dir))
    args = ["run", str(demo_dir), "--input-ids", "5 17 3 9 44 2", "--max-new-tokens", "6", "--hw", kw["hw"],
            "--device", "cpu", "--backend", "native", "--vram-budget-gb", str(kw["vram_budget_gb"]), "--allow-oversize",
            "--max-seq-len", "64"]
    assert main([*args, "--expert-cache", "--refill-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "expert cache: layers" in out and "every 2 decoded tokens" in out
    # after the text, what the cache did: its hit share, copies and host time
    summary = re.search(r"expert cache: (\d+)% of the decoded picks on GPU rows, (\d+) experts copied in "
                        r"\(([\d.]+) MB a decoded token\), the host ([\d.]+) ms a decoded token", out)
    assert summary and 0 <= int(summary[1]) <= 100 and int(summary[2]) > 0 and float(summary[3]) > 0
    assert main([*args, "--expert-cache", "--refill-every", "2", "--prefill-experts", "stream"]) == 0  # cached layers whole
    capsys.readouterr()
    assert main([*args, "--expert-cache", "--refill-every", "2", "--prefill-experts", "split"]) == 2
    assert "prefill_experts='split' with expert_cache" in capsys.readouterr().err
    assert main([*args[:-5], "--max-seq-len", "64", "--expert-cache", "--refill-every", "2"]) == 2  # no VRAM budget: nothing split
    assert "expert_cache=True" in capsys.readouterr().err


def curves_profile(path, experts=32, top_k=4, sticky=(3,), flat=(1, 2), intervals=(16, 32), batched=None):
    """A routing profile with uniform frequencies and cache curves: in `sticky` layers a cache of
    S rows serves 4 S / experts of the picks (more at the first interval, for fewer copies); in
    `flat` layers only S / experts (what static rows serve) and copies cost extra. `batched`:
    {B: (sticky, flat)} the same for batches of B conversations."""
    from ktflow.costmodel.routing import CacheCurve, RoutingProfile

    sizes = range(1, experts)

    def table(sticky, flat):
        cache = {}
        for i, every in enumerate(intervals):
            cache[every] = {}
            for layer in sticky:
                cache[every][layer] = CacheCurve(hits=[min(1.0, 4 * s / experts) - 0.05 * i for s in sizes],
                                                 copies=[0.1 * (1 + i) * s / experts for s in sizes])
            for layer in flat:
                cache[every][layer] = CacheCurve(hits=[s / experts for s in sizes],
                                                 copies=[0.2 * s / experts for s in sizes])
        return cache

    prof = RoutingProfile(layers={layer: [top_k / experts] * experts for layer in (*sticky, *flat)},
                          cache=table(sticky, flat),
                          cache_batched={b: table(*v) for b, v in batched.items()} if batched else None)
    path.write_text(prof.model_dump_json())
    return str(path)


def test_the_placement_pass_prices_the_cache_and_sizes_it_per_layer(demo_dir, tmp_path):
    """With cache curves in the routing profile, rows go where a cache serves most: the sticky
    layer 3 takes, as a cache refilled at the interval worth most, the rows its curve gains by
    (8: there it serves every pick), the rest of the budget stays with layer 1's static experts;
    a layer whose curve serves no more than static rows stays static."""
    model = ktflow.load(demo_dir)
    kw = dict(hw="rtx4090-desktop", device="cpu", allow_oversize=True, backend="native", max_seq_len=64,
              vram_budget_gb=0.008, routing_profile=curves_profile(tmp_path / "r.json"))

    def gpu_experts(c):
        return {n.attrs.layer: n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"}

    static, cached = gpu_experts(ktflow.compile(model, **kw)), gpu_experts(ktflow.compile(model, expert_cache=True, **kw))
    assert set(static) == {1} and 3 not in static  # without a cache: graph order among equal experts
    n = cached[3]
    assert n.attrs.refill_every == 16  # the first interval serves more for fewer copies
    assert "refills every 16 decoded tokens" in n.place.cause and "cache curves" in n.place.cause
    assert len(n.attrs.ids) == 8  # the pool's size: a ninth row would serve nothing more
    assert len(n.attrs.ids) + len(cached[1].attrs.ids) == len(static[1].attrs.ids)  # the same budget
    assert cached[1].attrs.refill_every == 0 and "no cache" in cached[1].place.cause
    assert "one conversation" not in n.place.cause
    # the curves come from single conversations: a plan for batches says what it does not model
    batched = gpu_experts(ktflow.compile(model, expert_cache=True, **dict(kw, max_batch=4)))
    cached_layers = [m for m in batched.values() if m.attrs.refill_every]
    assert cached_layers and all("priced for one conversation: a batch of up to 4" in m.place.cause
                                 for m in cached_layers)
    # a plan for batches reads the profile's batched curves: in batches of 2, layer 3's reads
    # spread (a flat curve) and its cache is off; layer 3 in batches of 4 stays sticky, and the
    # plan for 8 is priced by them, the largest batch profiled
    spread = curves_profile(tmp_path / "b.json", batched={2: ((), (1, 2, 3)), 4: ((3,), (1, 2))})
    pair = gpu_experts(ktflow.compile(model, expert_cache=True, **dict(kw, max_batch=2, routing_profile=spread)))
    assert pair and all(m.attrs.refill_every == 0 for m in pair.values())
    eight = gpu_experts(ktflow.compile(model, expert_cache=True, **dict(kw, max_batch=8, routing_profile=spread)))
    assert eight[3].attrs.refill_every and "priced for 4 conversations decoded together (the largest batch the " \
        "profile holds; the plan's is up to 8)" in eight[3].place.cause and "expert reads" in eight[3].place.cause
    # a layer the batched curves leave out is priced by one conversation's, and says so
    partial = curves_profile(tmp_path / "p.json", batched={4: ((), (1,))})
    some = gpu_experts(ktflow.compile(model, expert_cache=True, **dict(kw, max_batch=4, routing_profile=partial)))
    assert some[3].attrs.refill_every and "priced for one conversation" in some[3].place.cause
    # curves that serve no more than static rows: the cache is off
    flat = dict(kw, routing_profile=curves_profile(tmp_path / "f.json", sticky=(), flat=(1, 2, 3)))
    c = ktflow.compile(model, expert_cache=True, **flat)
    parts = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]
    assert parts and all(n.attrs.refill_every == 0 for n in parts)
    assert any("no cache" in n.place.cause for n in parts)
    with pytest.raises(ConfigError, match="expert_cache=True"):
        ExpertCache(c)


def test_the_pass_prices_each_copy_at_its_time_over_pcie(demo_dir, tmp_path):
    """A refill's copy costs the decode steps its bytes' time over PCIe: the same curves that make
    the sticky layer a cache over the preset's link price it below static experts over a link a
    thousand times slower, and the pass turns the cache off."""
    from ktflow.costmodel.hw import PRESETS

    model = ktflow.load(demo_dir)
    fast = PRESETS["rtx4090-desktop"]
    slow = fast.model_copy(update={"gpus": [fast.gpus[0].model_copy(update={"pcie_h2d_gbps": 0.025})]})
    kw = dict(device="cpu", allow_oversize=True, backend="native", max_seq_len=64, vram_budget_gb=0.008,
              routing_profile=curves_profile(tmp_path / "r.json"), expert_cache=True)

    def gpu_parts(hw):
        return [n for n in ktflow.compile(model, hw=hw, **kw).decode.ir.nodes
                if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]

    assert any(n.attrs.layer == 3 and n.attrs.refill_every for n in gpu_parts(fast))
    parts = gpu_parts(slow)
    assert parts and all(n.attrs.refill_every == 0 and "no cache" in n.place.cause for n in parts)


def test_a_failed_copy_leaves_the_expert_on_the_cpu_and_decoding_goes_on(demo_dir, tmp_path, capsys):
    """A copy that fails warns once; its rows stay empty and the experts are computed on the CPU,
    so the logits stay the no-cache plan's; the next refill copies them."""
    model = ktflow.load(amplified(demo_dir, tmp_path / "amplified"))
    kw = split_options(model)
    ref = decode_logits(ktflow.compile(model, prefill_experts="cpu", **kw))
    c = ktflow.compile(model, expert_cache=True, **kw)
    cache = ExpertCache(c)
    cache.follow(every=2)
    layer = cached_node(c).attrs.layer
    stager = cache.stagers[layer]
    stager.stage = broken_stage
    got = decode_logits(c)
    assert cache.failures > 0 and "device copy failed" in capsys.readouterr().err
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    assert -1 in cache.layers[layer].resident  # emptied, never filled
    assert_each_expert_computed_once(cache)
    del stager.stage  # the class's method again
    got = decode_logits(c)  # the refills copy again
    cache.stop()
    assert -1 not in cache.layers[layer].resident
    assert_each_expert_computed_once(cache)
    rows_hold_their_experts(c, cache)
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()


def test_a_refill_after_a_failed_copy_keeps_the_other_experts_where_they_are(demo_dir):
    """A failed copy leaves its rows empty (-1); the next refill reuses them without touching the
    experts that stay (an empty row names no expert: taken as an index, -1 would be the last
    expert's entry in the map)."""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model))
    cache = ExpertCache(c)
    n = cached_node(c)
    layer, experts, rows = n.attrs.layer, n.attrs.experts, len(n.attrs.ids)
    last = experts - 1
    others = [e for e in range(experts) if e != last]
    cache.refill(layer, [last, *others[:rows - 1]])  # the last expert resident
    stager = cache.stagers[layer]
    stager.stage = broken_stage
    cache.refill(layer, [last, *others[rows - 1:2 * rows - 2]])  # its copies fail: empty rows
    assert -1 in cache.layers[layer].resident
    del stager.stage
    cache.refill(layer, [last, *others[:rows - 1]])  # the first ones again, into the empty rows
    assert sorted(cache.resident(layer)) == sorted([last, *others[:rows - 1]])
    assert_each_expert_computed_once(cache)
    rows_hold_their_experts(c, cache)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])  # (int4 experts: this model's plan puts none on the GPU)
def test_a_refilled_quantized_expert_computes_with_the_cpus_weights(demo_dir, fmt):
    """With int8 or FP8 CPU experts (quantized here from the bf16 checkpoint), an expert refilled
    into a row is copied from the CPU's packed (quantized) copy: its row holds the dequantized
    weights the CPU computes it with, not the checkpoint's, and each expert is still computed once."""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model, expert_format=fmt))
    cache = ExpertCache(c)
    n = cached_node(c)
    outside = [e for e in range(n.attrs.experts) if e not in n.attrs.ids][:len(n.attrs.ids)]
    cache.refill(n.attrs.layer, outside)
    assert_each_expert_computed_once(cache)
    cl = cache.layers[n.attrs.layer]
    node, stacked = cl.stacks[0]
    gate_ref = next(r for r in node.weights if r.experts and r.role == "gate")
    e = cl.resident[0]
    exact = c.model.weights.load_expert(gate_ref, e).float()
    got = stacked["gate"][0].float()
    # the quantized copy: close to the checkpoint's (a few percent of its range), but not it
    assert not torch.equal(got, exact.to(got.dtype))
    assert (got - exact).abs().max() <= (0.02 if fmt == "int8" else 0.1) * exact.abs().max()


def test_a_refill_copies_its_experts_in_arena_order(demo_dir):
    """The incoming experts are staged in id order (the CPU arena's), whatever order the refill
    ranks them in, so neighbours go as one copy; each still lands in a row of its own."""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model))
    cache = ExpertCache(c)
    n = cached_node(c)
    stager = cache.stagers[n.attrs.layer]
    staged_subsets = []
    stage = stager.stage

    def recording(subset, *args, **kwargs):
        staged_subsets.append(tuple(subset))
        return stage(subset, *args, **kwargs)

    stager.stage = recording
    outside = [e for e in range(n.attrs.experts) if e not in n.attrs.ids][:len(n.attrs.ids)]
    ranked = outside[::-1]  # most counted last id first
    assert cache.refill(n.attrs.layer, ranked) == len(ranked)
    assert staged_subsets and [e for s in staged_subsets for e in s] == sorted(ranked)
    assert sorted(cache.resident(n.attrs.layer)) == sorted(ranked)
    rows_hold_their_experts(c, cache)


def test_the_hit_share_counts_each_decoded_pick_on_a_filled_slot(demo_dir):
    """`served / picked` replayed step by step: a decoded pick is served when its expert's row
    was filled during that step (a copy lands at the step end after its refill, so for one step
    the expert is the CPU's), counted when a later decode step's refill closes its window (a
    prefill's refill drops the window's picks)."""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, expert_cache=True, **split_options(model))
    cache = ExpertCache(c)
    rec = cache.follow(every=3)
    layers = sorted(cache.layers)
    state = dict(after={}, open={layer: [0, 0] for layer in layers}, served=0, picked=0)

    def before(executor, tokens):  # the step just run: its picks, and the rows filled during it
        counts = {layer: rec.counts[layer].cpu().clone() for layer in layers if layer in rec.counts}
        for layer, now in counts.items():
            picks = now - state["after"].get(layer, torch.zeros_like(now))
            held = [e for e in cache.layers[layer].resident if e >= 0]
            state["open"][layer][0] += int(picks[held].sum())
            state["open"][layer][1] += int(picks.sum())
        state["before"] = counts

    def after(executor, tokens):  # windows the cache's refills closed at this step end
        for layer in layers:
            if cache.since[layer] == 0:
                if executor.plan.phase == "decode":
                    state["served"] += state["open"][layer][0]
                    state["picked"] += state["open"][layer][1]
                state["open"][layer] = [0, 0]
        state["after"] = {layer: rec.counts[layer].cpu().clone() for layer in layers if layer in rec.counts}

    for plan in (c.decode, *c.prefill):
        hooks = c.executor(plan).after_run
        hooks.insert(0, before)
        hooks.append(after)
    for _ in range(2):  # two conversations: the second's prompt refill drops the first's open window
        decode_logits(c, steps=8)
    cache.stop()
    assert cache.copied > 0 and state["picked"] > 0
    assert (cache.served, cache.picked) == (state["served"], state["picked"])
    assert cache.served < cache.picked
