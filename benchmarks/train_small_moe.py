"""Train a small DeepSeek-V3-style MoE with learned routing, here, on text every machine has.

Random-weight models route about uniformly, so nothing about hot experts, expert caches or
Expert Deferral's accuracy can be measured on them. This trains one whose routing is learned:

- corpus: the Python standard library's own sources (`*.py` under `sysconfig`'s stdlib path,
  site-packages left out), files in path order; a file goes to the held-out split when a hash of
  its relative path says so (5%), so the split does not depend on the machine's file order;
- tokenizer: a byte-level BPE trained on the training split (`tokenizers`), saved as the
  checkpoint's tokenizer.json;
- model: `transformers`' DeepseekV3ForCausalLM (MLA attention, a dense first layer, routed
  experts with a shared one, the sigmoid router with group-limited top-k), sizes by `--size`:
  `tiny` trains on 2 CPU cores in under a minute (150 steps, 307k tokens), `small` is sized for the
  GPU machine;
- the routed experts' training forward: the tokens gathered by expert into one padded
  [experts, rows, H] batch, two batched matmuls, and gathered back (`sorted_experts_forward`):
  every step of it is a gather or a plain sum, so its backward has no scatter-adds (the atomics
  that make a backward non-deterministic, and that PyTorch's deterministic mode replaces by slow
  sorted kernels); the same function as transformers' experts, to rounding (a test compares them);
  float32 matmuls in TF32 on the GPU (deterministic as well);
- the multi-token-prediction (MTP) layer, as DeepSeek-V3 publishes it (`enorm`, `hnorm`,
  `eh_proj`, one MoE decoder layer, `shared_head.norm`; embedding and head the main model's),
  trained after the model for `--mtp-steps` steps with the model frozen: from the model's final
  normalised hidden state at position i and token i + 1 it predicts token i + 2 (cross-entropy);
  saved as layer `num_hidden_layers` with `num_nextn_predict_layers: 1` (0 steps: none);
- router balancing: DeepSeek-V3's auxiliary-loss-free rule: after every step each MoE layer's
  score-correction bias moves by `--bias-rate` towards its under-loaded experts (bias_e +=
  rate * sign(mean load - load_e)); no auxiliary loss;
- deterministic by `--seed` (data order, initialisation), bit for bit: PyTorch's deterministic
  algorithms, a fixed cuBLAS workspace and attention by the math kernel. Without them some sums in
  the backward pass run in a different order every run: the weights differed in the last bits on
  the CPU, and two runs of the same commit on the same H100 ended at held-out perplexity 41.81 and
  43.31. An op with no deterministic kernel warns (`use_deterministic_algorithms(warn_only=True)`),
  and the report lists it (`nondeterministic`).

Writes `save_pretrained` files (ktflow.load and transformers both read them), tokenizer.json and
tokenizer_config.json, `heldout.safetensors` (the held-out split's token ids, for
benchmarks/fidelity.py) and `train_report.json` (steps, tokens, seconds, training loss, held-out
perplexity, each MoE layer's expert load on the held-out split, a SHA-256 of the weights), and appends one row to
benchmarks/train_small_moe.jsonl.

    python benchmarks/train_small_moe.py --size tiny -o /tmp/moe-tiny        # CPU, under a minute
    python benchmarks/train_small_moe.py --size small -o /tmp/moe-small      # GPU machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402

SIZES = {
    "tiny": dict(model=dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=32, num_experts_per_tok=4,
                            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64,
                            q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32),
                 vocab=2048, seq=128, batch=16, steps=150, lr=4e-3, corpus_mb=3, mtp_steps=150),
    "small": dict(model=dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, n_routed_experts=64, num_experts_per_tok=6,
                             n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128,
                             q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64),
                  vocab=8192, seq=256, batch=32, steps=1500, lr=2e-3, corpus_mb=40, mtp_steps=600),
}


def corpus(limit_mb: float) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the stdlib's .py files, path order, split by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held, size = [], [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        (held if hashlib.sha256(rel.encode()).digest()[0] < 13 else train).append(text)  # 13/256: about 5%
        size += len(text)
        if size > limit_mb * 1e6 and held:  # (at least one held-out file)
            break
    if not train or not held:
        raise SystemExit(f"no usable .py sources under {root}")
    return train, held


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def pick_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of `ids` name each expert (int64 [experts]), by a sort and a binary search: the same
    as bincount, without the kernel PyTorch's deterministic mode warns about on the GPU."""
    edges = torch.searchsorted(ids.reshape(-1).sort().values, torch.arange(experts + 1, device=ids.device))
    return edges.diff()


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index], where index x.shape[0] names a row of zeros."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[index]


class _Gather(torch.autograd.Function):
    """_rows(x, index), given `back`, the inverse map (each of x's rows -> where it went, or past
    the end for a row gathered nowhere): its gradient is _rows(grad, back). Both ways a gather, no
    scatter-add: deterministic, with nothing for PyTorch's deterministic mode to slow down."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return _rows(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _rows(grad, back), None, None


def sorted_experts_forward(experts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3Experts forward (fused gate_up_proj [E, 2I, H], down_proj [E, H, I]),
    computed as one batched matmul over the experts: each token's row repeated k times, gathered
    into [E, C, H] (expert e's rows in a stable sort of the expert ids, then zero rows up to C, the
    busiest expert's count), a SwiGLU per expert by two bmm, gathered back to the (token, pick)
    rows, and each token's k outputs summed by their routing weights. Every index move is a
    `_Gather` both ways (the repeat's gradient a sum): deterministic by construction, and a few
    kernels a layer instead of a few per expert."""
    tokens, width = hidden.shape
    k = top_k_index.shape[-1]
    n, e = tokens * k, experts.num_experts
    ids = top_k_index.reshape(-1)
    perm = torch.argsort(ids, stable=True)  # the (token, pick) rows by expert
    counts = pick_counts(ids, e)
    cap = int(counts.max())
    starts = counts.cumsum(0) - counts
    j = torch.arange(cap, device=ids.device)
    at = (starts[:, None] + j).clamp(max=n - 1)
    src = torch.where(j < counts[:, None], perm[at], n).reshape(-1)  # [E * C] -> its row, or n: zeros
    by_expert = ids[perm]
    slot = (by_expert * cap + torch.arange(n, device=ids.device) - starts[by_expert])[perm.argsort()]  # row -> [E * C]
    rows = hidden.unsqueeze(1).expand(tokens, k, width).reshape(n, width)
    x = _Gather.apply(rows, src, slot).view(e, cap, width)
    gate, up = torch.bmm(x, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2)).reshape(e * cap, width)
    y = _Gather.apply(y, slot, src).view(tokens, k, width)
    return (y * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)


def use_sorted_experts(model) -> int:
    """Route each MoE layer's experts through sorted_experts_forward; the number of layers."""
    n = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        if not all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn", "num_experts")):
            raise SystemExit(f"this transformers' DeepseekV3 experts ({type(experts).__name__}) do not hold fused "
                             "gate_up_proj/down_proj weights; train_small_moe.py needs transformers >= 5")
        experts.forward = lambda h, i, w, e=experts: sorted_experts_forward(e, h, i, w)
        n += 1
    return n


def load_per_layer(model, ids: torch.Tensor, seq: int, device) -> dict[int, list[float]]:
    """Each MoE layer's fraction of picks per expert over `ids` (in sequences of `seq`)."""
    counts: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue

        def hook(mod, args, out, i=i):
            counts[i] = counts.get(i, 0) + pick_counts(out[2], mod.num_experts).cpu()
        hooks.append(gate.register_forward_hook(hook))
    n = len(ids) // seq * seq
    with torch.no_grad():
        for lo in range(0, n, seq * 8):
            model(ids[lo:min(n, lo + seq * 8)].view(-1, seq).to(device))
    for h in hooks:
        h.remove()
    return {i: (c / c.sum()).tolist() for i, c in counts.items()}


def perplexity(model, ids: torch.Tensor, seq: int, device) -> float:
    n = len(ids) // seq * seq
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, n, seq * 8):
            x = ids[lo:min(n, lo + seq * 8)].view(-1, seq).to(device)
            out = model(x, labels=x)
            total += float(out.loss) * x.shape[0] * (seq - 1)
            count += x.shape[0] * (seq - 1)
    return math.exp(total / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("-o", "--out", required=True, help="checkpoint dir to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the size's)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop training after this many seconds and save what was trained (the report says how many "
                    "steps ran; the learning rate will not have decayed; a run cut short is deterministic no more)")
    ap.add_argument("--bias-rate", type=float, default=1e-2, help="the balancing bias's step per optimizer step")
    ap.add_argument("--mtp-steps", type=int, default=None,
                    help="optimizer steps of the MTP layer after the model (default: the size's, scaled as the "
                    "model's steps that ran scale the size's; 0: no MTP layer)")
    ap.add_argument("--corpus-mb", type=float, default=None, help="MB of sources read (default: the size's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--jsonl", default=str(HERE / "train_small_moe.jsonl"))
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # run for run the same sums: before cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls in TF32 on the GPU: fast, still deterministic
    # attention by the math kernel: the memory-efficient one (what sdpa picks for these float32 heads
    # of unequal q/v sizes) keeps its split, non-deterministic backward under warn_only
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return train(a, caught)


def train(a: argparse.Namespace, caught: list) -> int:
    """The run main() sets up; `caught` collects the warnings (the report lists those that say an
    op ran without a deterministic kernel)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

    size = SIZES[a.size]
    steps = a.steps or size["steps"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    train_texts, held_texts = corpus(a.corpus_mb or size["corpus_mb"])
    tok = train_tokenizer(train_texts, size["vocab"])
    train_ids, held_ids = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(f"corpus: {len(train_texts)} files, {len(train_ids)} tokens to train on; held out {len(held_texts)} files, "
          f"{len(held_ids)} tokens; tokenizer {tok.get_vocab_size()} tokens ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    cfg = DeepseekV3Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=4 * size["seq"],
                           rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True,
                           routed_scaling_factor=1.0, initializer_range=0.02,
                           bos_token_id=tok.token_to_id("<|bos|>"), eos_token_id=tok.token_to_id("<|eos|>"),
                           **size["model"])
    model = DeepseekV3ForCausalLM(cfg).to(a.device)
    use_sorted_experts(model)
    opt = torch.optim.AdamW(model.parameters(), lr=size["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(getattr(layer.mlp, "gate", None),
                                                                       "e_score_correction_bias")]
    picks: dict[int, torch.Tensor] = {}
    for i, g in enumerate(gates):
        g.register_forward_hook(lambda mod, args, o, i=i: picks.__setitem__(
            i, pick_counts(o[2], mod.num_experts)))
    seq, batch = size["seq"], size["batch"]
    windows = (len(train_ids) - 1) // seq
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(a.seed))
    model.train()
    t1 = time.perf_counter()
    losses = []
    for step in range(steps):
        rows = order[(step * batch + torch.arange(batch)) % windows]
        x = torch.stack([train_ids[r * seq:(r + 1) * seq] for r in rows.tolist()]).to(a.device)
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():  # auxiliary-loss-free balancing: nudge each layer's bias toward its idle experts
            for i, g in enumerate(gates):
                load = picks[i].float()
                g.e_score_correction_bias += a.bias_rate * torch.sign(load.mean() - load)
        losses.append(loss.item())
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.3f}  {time.perf_counter() - t1:.0f} s", flush=True)
        if a.time_limit is not None and time.perf_counter() - t1 > a.time_limit and step < steps - 1:
            print(f"stopped by --time-limit {a.time_limit:g} s after {step + 1} of {steps} steps", flush=True)
            break
    trained = len(losses)  # (`steps` stays the planned count: the schedule reads it)
    train_s = time.perf_counter() - t1
    model.eval()
    ppl = perplexity(model, held_ids, seq, a.device)
    load = load_per_layer(model, held_ids, seq, a.device)
    # the size's MTP steps, scaled as the model's steps that ran (--steps, --time-limit) scale the size's
    mtp_steps = max(1, round(size["mtp_steps"] * trained / size["steps"])) if a.mtp_steps is None else a.mtp_steps
    mtp, mtp_report = train_mtp(model, train_ids, held_ids, order, size, mtp_steps, a) if mtp_steps else (None, {})
    model = model.to("cpu")
    model.save_pretrained(out)
    if mtp is not None:
        save_mtp(out, mtp, cfg.num_hidden_layers)
    tok_json = out / "tokenizer.json"
    tok.save(str(tok_json))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>").save_pretrained(out)
    from safetensors.torch import save_file

    save_file({"ids": held_ids}, str(out / "heldout.safetensors"))
    k = size["model"]["num_experts_per_tok"]
    busiest = {i: round(sum(sorted(fr, reverse=True)[:max(1, len(fr) // 10)]), 4) for i, fr in load.items()}
    digest = hashlib.sha256()  # of the trained weights, so two runs can be compared bit for bit
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    report = dict(size=a.size, seed=a.seed, steps=trained, planned_steps=steps, tokens=trained * batch * seq, train_seconds=round(train_s, 1),
                  final_loss=round(sum(losses[-10:]) / len(losses[-10:]), 4), heldout_tokens=len(held_ids),
                  heldout_perplexity=round(ppl, 3), top_k=k, experts=size["model"]["n_routed_experts"],
                  busiest_tenth_share=busiest, load=load, weights_sha256=digest.hexdigest(),
                  nondeterministic=sorted({str(w.message).splitlines()[0][:300] for w in caught
                                           if "determinis" in str(w.message)}),
                  corpus=str(Path(sysconfig.get_paths()["stdlib"])), **mtp_report)
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    print(f"trained {trained} steps ({report['tokens']} tokens) in {train_s:.0f} s on {a.device}; final loss "
          f"{report['final_loss']:.3f}; held-out perplexity {ppl:.2f}; the busiest 10% of experts take "
          + ", ".join(f"L{i} {100 * s:.0f}%" for i, s in busiest.items()) + " of the picks (uniform: 10%)")
    if mtp_report:
        print(f"MTP layer: {mtp_report['mtp_steps']} steps, final loss {mtp_report['mtp_final_loss']:.3f}; on the "
              f"held-out split its draft equals the next-next token at {100 * mtp_report['mtp_heldout_top1']:.1f}% "
              f"(the model's own next token: {100 * mtp_report['heldout_top1']:.1f}%)")
    for msg in report["nondeterministic"]:
        print(f"not deterministic: {msg}", file=sys.stderr)
    append_jsonl(a.jsonl, [dict(bench="train_small_moe", commit=commit(), **machine(), device=a.device,
                                **{k2: v for k2, v in report.items() if k2 != "load"})])
    print(f"wrote {out}")
    return 0


class MTPLayer(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction layer over a frozen model: at position i, from the
    model's final normalised hidden state h_i and token i + 1, x = eh_proj([enorm(embed(t_{i+1}));
    hnorm(h_i)]), one MoE decoder layer (index num_hidden_layers) and shared_head.norm, then the
    model's own head: logits of token i + 2."""

    def __init__(self, model):
        from transformers import DeepseekV3ForCausalLM

        super().__init__()
        cfg = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
        self.block = DeepseekV3ForCausalLM(cfg)  # its one layer (an MoE one), its final norm = shared_head.norm
        self.block.model.embed_tokens = model.model.embed_tokens  # shared, frozen
        self.block.lm_head = model.lm_head
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = torch.nn.RMSNorm(h, eps=eps), torch.nn.RMSNorm(h, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)

    def forward(self, model, x: torch.Tensor, labels: bool = True):
        with torch.no_grad():
            hidden = model.model(x).last_hidden_state  # after the model's final norm
        e = self.block.model.embed_tokens(x[:, 1:])
        inp = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden[:, :-1])], -1))
        # row i predicts token i + 2: as a causal LM whose labels are x shifted by one
        return self.block(inputs_embeds=inp, labels=x[:, 1:] if labels else None)

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's tensors by their checkpoint names (model.layers.<layer>.*)."""
        p = f"model.layers.{layer}"
        out = {f"{p}.{k}": v for k, v in self.block.model.layers[0].state_dict().items()}
        out.update({f"{p}.enorm.weight": self.enorm.weight, f"{p}.hnorm.weight": self.hnorm.weight,
                    f"{p}.eh_proj.weight": self.eh_proj.weight,
                    f"{p}.shared_head.norm.weight": self.block.model.norm.weight})
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def train_mtp(model, train_ids: torch.Tensor, held_ids: torch.Tensor, order: torch.Tensor, size: dict, steps: int,
              a: argparse.Namespace) -> tuple[MTPLayer, dict]:
    """The MTP layer trained `steps` steps over the frozen model (the same windows, in the same
    order as the model saw them), and its report: final loss, and on the held-out split how often
    its argmax is the next-next token beside how often the model's is the next one."""
    for prm in model.parameters():
        prm.requires_grad_(False)
    mtp = MTPLayer(model).to(a.device)
    use_sorted_experts(mtp.block)
    params = [q for n, q in mtp.named_parameters() if not n.startswith(("block.model.embed_tokens", "block.lm_head"))]
    opt = torch.optim.AdamW(params, lr=size["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    seq, batch = size["seq"], size["batch"]
    windows = (len(train_ids) - 1) // seq
    mtp.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        rows = order[(step * batch + torch.arange(batch)) % windows]
        x = torch.stack([train_ids[r * seq:(r + 1) * seq] for r in rows.tolist()]).to(a.device)
        loss = mtp(model, x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"mtp step {step:5d}  loss {losses[-1]:.3f}  {time.perf_counter() - t0:.0f} s", flush=True)
    mtp.eval()
    hits = model_hits = total = 0
    with torch.no_grad():
        for r in range(min((len(held_ids) - 1) // seq, 64)):
            x = held_ids[r * seq:(r + 1) * seq].view(1, -1).to(a.device)
            drafts = mtp(model, x, labels=False).logits[0].argmax(-1)  # row i: token i + 2
            nxt = model(x).logits[0].argmax(-1)  # row i: token i + 1
            hits += int((drafts[:-1] == x[0, 2:]).sum())
            model_hits += int((nxt[:-2] == x[0, 1:-1]).sum())  # over the same count of positions
            total += seq - 2
    return mtp, dict(mtp_steps=steps, mtp_train_seconds=round(time.perf_counter() - t0, 1),
                     mtp_final_loss=round(sum(losses[-10:]) / len(losses[-10:]), 4),
                     mtp_heldout_top1=round(hits / max(total, 1), 4), heldout_top1=round(model_hits / max(total, 1), 4))


def save_mtp(out: Path, mtp: MTPLayer, layers: int) -> None:
    """Add the MTP layer's tensors to the saved checkpoint (its one safetensors file) and declare it
    in config.json (num_nextn_predict_layers: 1)."""
    from safetensors.torch import load_file, save_file

    files = sorted(out.glob("model*.safetensors"))
    if len(files) != 1:
        raise SystemExit(f"expected one weights file in {out}, found {[f.name for f in files]}")
    tensors = load_file(str(files[0]))
    tensors.update(mtp.tensors(layers))
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    cfg_file = out / "config.json"
    raw = json.loads(cfg_file.read_text())
    raw["num_nextn_predict_layers"] = 1
    cfg_file.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
