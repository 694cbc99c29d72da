"""Issue 42's user-configuration targets from one run's rows (user_configs.py and llama_user.py
write them to benchmarks/user_configs.jsonl under one run id): per model and VRAM limit, the
prefill, decode and VRAM tables with each target's ratio, met or not.

    python benchmarks/user_report.py [--run-id ID] [--jsonl benchmarks/user_configs.jsonl]

Targets (issue 42, deliverable 5): prefill at each length >= 3x llama.cpp's best mode at the same
VRAM and >= 70% of ktflow's own rate with every expert in CPU memory and VRAM free; greedy decode
>= 1.3x llama.cpp; sampled decode >= 1.3x llama.cpp and >= 0.95x ktflow's greedy one step a
launch; the prefill reservation costs decode <= 3% against the decode-only placement; the
predicted peak VRAM within 10% of the measured one in every row; no OOM at the limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def verdict(x: float | None, target: float) -> str:
    return "—" if x is None else (f"{x:.2f}x **met**" if x >= target else f"{x:.2f}x not met")


def load(path: Path, run_id: str | None) -> tuple[str, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("bench") == "user_configs"]
    if not rows:
        raise SystemExit(f"no user_configs rows in {path}")
    run_id = run_id or rows[-1]["run_id"]
    return run_id, [r for r in rows if r.get("run_id") == run_id]


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _roof(r: dict) -> str:
    """' (x% of its CPU roofline: y GB a token on the CPU)' where the row has it, else ''."""
    if not r or r.get("cpu_roofline_fraction") is None:
        return ""
    return (f" ({100 * r['cpu_roofline_fraction']:.0f}% of its CPU roofline: "
            f"{r['cpu_expert_bytes_per_token'] / 1e9:.2f} GB a token on the CPU)")


def _server(r: dict) -> bool:
    """A llama.cpp row run at one server configuration's -ncmoe (not chosen for its own test)."""
    return r.get("placement") == "server"


def server_table(rs: list[dict], pre: dict, t: dict, out) -> None:
    """ktflow's one plan against llama.cpp as one server configuration (every test at the -ncmoe
    of the longest prompt at the largest -ub, as llama-server -c/-ub holds it for prefill and
    decode alike); the targets' ratios stay against llama.cpp's best per test above."""
    srv = [r for r in rs if _server(r) and "tok_s" in r]
    if not srv:
        return
    out(f"\nllama.cpp as one server configuration ({srv[0]['system']}; each test above chose its own -ncmoe):")
    out("\n| test | llama.cpp, one configuration | ktflow at the limit | ratio |")
    out("|---|---|---|---|")
    for r in sorted((r for r in srv if r["table"] == "llama_prefill"), key=lambda r: r["prompt"]):
        u = pre.get(("user", r["prompt"]))
        vs = t[f"prefill{r['prompt']}_vs_llama_server"] = u["tok_s"] / r["tok_s"] if u else None
        mine = f"{u['tok_s']:.0f} +- {u['sd']:.0f}" if u else "—"
        out(f"| prefill {r['prompt']} | {r['tok_s']:.0f} +- {r['sd']:.0f} | {mine} | {_ratio(vs)} |")
    for r in (r for r in srv if r["table"] == "llama_decode"):
        depth = r.get("decode_depth") or 0
        for name in ("greedy", "sampled"):
            k = next((x for x in rs if x.get("table") == "decode" and x.get("variant") == name
                      and (x.get("decode_depth") or 0) == depth), None)
            vs = k["decode_tok_s"] / r["tok_s"] if k else None
            t[f"{name}_vs_llama_server" + (f"_at_{depth}" if depth else "")] = vs
            mine = f"{k['decode_tok_s']:.2f} +- {k['decode_sd']:.2f}" if k else "—"
            after = f" after {depth} tokens" if depth else ""
            out(f"| decode{after}, ktflow {name} | {r['tok_s']:.2f} +- {r['sd']:.2f} | {mine} | {_ratio(vs)} |")


def report(rows: list[dict], out=print) -> dict:
    """Print the tables; returns {(model, vram_gb): {target: ratio}} for tests and callers."""
    got = {}
    for key in dict.fromkeys((r["model"], r["vram_gb"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["vram_gb"]) == key]
        t = got[key] = {}
        first = next((r for r in rs if r.get("gpu")), rs[0])
        out(f"\n## {key[0]} ({first.get('layers')} layers) at a {key[1]} GB VRAM limit: {first.get('gpu')}, "
            f"commit {first.get('commit')}")
        opt = next((r["vram_option"] for r in rs if r.get("vram_option")), None)
        if opt:
            out(f"ktflow's limit through: {opt}")
        pre = {(r["variant"], r["prompt"]): r for r in rs if r.get("table") == "prefill"}
        llama = [r for r in rs if r.get("table") == "llama_prefill" and "tok_s" in r and not _server(r)]
        out("\n| prompt | ktflow at the limit | ktflow, experts on CPU, VRAM free | llama.cpp best at the limit "
            "| vs llama.cpp (>= 3x) | vs own free-VRAM rate (>= 0.7) |")
        out("|---|---|---|---|---|---|")
        for n in sorted({p for _, p in pre} | {r["prompt"] for r in llama}):
            u, f = pre.get(("user", n)), pre.get(("cpu-experts", n))
            best = max((r for r in llama if r["prompt"] == n), key=lambda r: r["tok_s"], default=None)
            vs_l = u["tok_s"] / best["tok_s"] if u and best else None
            vs_f = u["tok_s"] / f["tok_s"] if u and f else None
            t[f"prefill{n}_vs_llama"], t[f"prefill{n}_vs_free"] = vs_l, vs_f
            cell = lambda r: f"{r['tok_s']:.0f} +- {r['sd']:.0f}" if r else "—"  # noqa: E731
            how = f" ({u['decisions']})" if u else ""
            mode = f" ({best['system']})" if best else ""
            out(f"| {n} | {cell(u)}{how} | {cell(f)} | {cell(best)}{mode} | {verdict(vs_l, 3.0)} | "
                f"{verdict(vs_f, 0.7)} |")
        dec = {r["variant"]: r for r in rs if r.get("table") == "decode" and not r.get("decode_depth")}
        tg = max((r for r in rs if r.get("table") == "llama_decode" and "tok_s" in r and not r.get("decode_depth")
                  and not _server(r)),
                 key=lambda r: r["tok_s"], default=None)
        smp = next((r for r in rs if r.get("table") == "llama_sampler"), None)
        ab = {r["variant"]: r for r in rs if r.get("table") == "decode_ab"}
        if dec or tg:
            out("\n| decode | tok/s | vs llama.cpp tg best (>= 1.3x) | other target |")
            out("|---|---|---|---|")
            if tg:
                out(f"| llama.cpp tg (no sampler), {tg['system']}, {tg['threads']} threads | {tg['tok_s']:.2f} +- "
                    f"{tg['sd']:.2f}{_roof(tg)} | 1.00x | |")
            if smp and smp.get("sampled_estimate_tok_s"):
                out(f"| llama.cpp + its default sampler ({smp['sampler_ms']} ms a token, timed apart) | "
                    f"{smp['sampled_estimate_tok_s']:.2f} (estimate) | | |")
            one = dec.get("greedy, one step a launch")
            for name, r in dec.items():
                vs = r["decode_tok_s"] / tg["tok_s"] if tg else None
                other = ""
                if name == "greedy":
                    t["greedy_vs_llama"] = vs
                if name == "sampled":
                    t["sampled_vs_llama"] = vs
                    t["sampled_vs_one_step"] = r["decode_tok_s"] / one["decode_tok_s"] if one else None
                    other = f"vs greedy one step a launch (>= 0.95x): {verdict(t['sampled_vs_one_step'], 0.95)}"
                    if smp and smp.get("sampled_estimate_tok_s"):
                        est = r["decode_tok_s"] / smp["sampled_estimate_tok_s"]
                        other += f"; vs llama.cpp sampled estimate {est:.2f}x"
                out(f"| ktflow {name} | {r['decode_tok_s']:.2f} +- {r['decode_sd']:.2f}{_roof(r)} | "
                    f"{verdict(vs, 1.3) if name != 'greedy, one step a launch' else (f'{vs:.2f}x' if vs else '—')} "
                    f"| {other} |")
            for depth in sorted({r["decode_depth"] for r in rs if r.get("decode_depth")}):
                at = [r for r in rs if r.get("decode_depth") == depth]
                ltg = max((r for r in at if r.get("table") == "llama_decode" and "tok_s" in r and not _server(r)),
                          key=lambda r: r["tok_s"], default=None)
                if ltg:
                    out(f"| llama.cpp tg after {depth} tokens (-d), {ltg['system']}, {ltg['threads']} threads | "
                        f"{ltg['tok_s']:.2f} +- {ltg['sd']:.2f} | 1.00x | |")
                for r in (r for r in at if r.get("table") == "decode"):
                    vs = r["decode_tok_s"] / ltg["tok_s"] if ltg else None
                    t[f"{r['variant']}_vs_llama_at_{depth}"] = vs
                    out(f"| ktflow {r['variant']} after {depth} tokens | {r['decode_tok_s']:.2f} +- "
                        f"{r['decode_sd']:.2f} | {verdict(vs, 1.3)} | |")
            if ab.get("greedy", {}).get("vs_decode_only"):
                g, d = ab["greedy"], ab["decode-only greedy"]
                t["reservation_cost"] = 1 - g["vs_decode_only_paired"]
                ratios = [u / o for u, o in zip(g.get("per_round", []), d.get("per_round", []))]
                spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
                t["reservation_cost_se"] = spread
                out(f"| prefill reservation, same rounds: at the limit {g['decode_tok_s']:.2f} vs decode-only "
                    f"{d['decode_tok_s']:.2f} ({d['gpu_experts']} GPU experts against {g['gpu_experts']}) | "
                    f"{g['vs_decode_only']:.4f}x (rounds' mean {g['vs_decode_only_paired']:.4f}x) | | cost <= 3%: "
                    f"{'**met**' if t['reservation_cost'] <= 0.03 else 'not met'} "
                    f"({100 * t['reservation_cost']:.1f}%"
                    + (f" ± {100 * spread:.1f}% standard error of {len(ratios)} rounds" if spread else "") + ") |")
        server_table(rs, pre, t, out)
        vr = [r for r in rs if r.get("table") == "vram"]
        lv = [r for r in rs if r.get("table", "").startswith("llama_") and "process_gb" in r]
        if vr or lv:
            out("\n| VRAM row | predicted GB | allocated (vs prediction) | process on the card "
                "past its context (vs prediction) | within 10% |")
            out("|---|---|---|---|---|")
            worst = 0.0
            for r in vr:
                # the process past its context against the prediction, from the raw fields (rows before
                # 2026-11-28 also stored an err_process against the prediction plus the reserve)
                r = dict(r, err_process=round(r["process_gb"] / r["predicted_gb"] - 1, 4) if r.get("process_gb") else None)
                errs = [abs(e) for e in (r.get("err_allocated"), r.get("err_process")) if e is not None]
                worst = max([worst, *errs])
                pct = lambda e: "—" if e is None else f"{100 * e:+.1f}%"  # noqa: E731
                out(f"| ktflow {r['variant']} (plans {', '.join(r['plans'])}) | {r['predicted_gb']} | "
                    f"{r.get('max_allocated_gb')} ({pct(r.get('err_allocated'))}) | {r.get('process_gb')} "
                    f"({pct(r.get('err_process'))}) | "
                    f"{'yes' if errs and max(errs) <= 0.10 else 'no' if errs else '—'} |")
            t["vram_worst_error"] = worst if vr else None
            for r in lv:
                out(f"| {r.get('system', r['table'])} {r.get('prompt', r.get('decode_tokens', ''))} | limit "
                    f"{r['vram_limit_gb']} | buffers {sum(r['buffers_gb'].values()):.2f} | {r['process_gb']} "
                    f"({'polled' if r.get('process_polled') else 'buffers + overhead'}) | "
                    f"{'within the limit' if r['within_limit'] else 'OVER the limit'} |")
        errs = [r for r in rs if r.get("table") == "error"]
        t["oom"] = bool(errs)
        for r in errs:
            out(f"\n**{r['error']} in phase {r['phase']}** at the {r.get('cap_gb')} GB cap: {r['message'][:300]}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-id", default=None, help="default: the last run in the file")
    ap.add_argument("--jsonl", default=str(HERE / "user_configs.jsonl"))
    a = ap.parse_args(argv)
    run_id, rows = load(Path(a.jsonl), a.run_id)
    print(f"# user configurations, run {run_id} ({len(rows)} rows)")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
