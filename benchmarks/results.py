"""benchmarks/RESULTS.md from the benchmarks' JSONL rows: tables per benchmark and machine, each
row with its commit, after the hand-written summary in benchmarks/SUMMARY.md.

    make results        (= .venv/bin/python benchmarks/results.py)
    python benchmarks/results.py [--bench-dir DIR] [--out FILE] [--check]

Reads every DIR/*.jsonl (default: this folder), one section per file (its stem); the section's
description is the first sentence of DIR/<stem>.py's module docstring, read with `ast` (the
benchmark is never imported). Rows are grouped by the GPU they name, else by CPU and host. The
columns per benchmark are in SPECS below; a benchmark not listed there gets the scalar fields most
of its rows carry. The output is a function of the input files only (no clock, no environment),
written atomically (a temporary file in the same folder, then os.replace). A malformed line stops
the run with its file and line, exit status 2, and leaves the output untouched. --check compares
instead of writing (exit status 1 when the file would change).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ktflow.util.fsutil import write_atomic  # whole or not at all

HERE = Path(__file__).resolve().parent
COMMAND = "make results"
SCRIPT = "benchmarks/results.py"
MAX_ROWS = 40  # a table with more rows shows its latest run row by row, earlier runs one line each
MAX_STR = 60  # longer strings in a cell are cut
MISSING = object()  # the row lacks the field


class ResultsError(Exception):
    """Input that cannot be turned into the report (a malformed JSONL line, say)."""


# ------------------------------------------------------------------------------------------- columns

@dataclass(frozen=True)
class PM:
    """A mean with its spread, shown as "mean ± sd"."""
    mean: Any
    sd: Any = None


@dataclass(frozen=True)
class Col:
    header: str
    get: Callable[[dict], Any]


def f(name: str, header: str | None = None) -> Col:
    """A field as it is in the row."""
    return Col(header or name, lambda r: r.get(name, MISSING))


def pm(mean: str, sd: str, header: str | None = None) -> Col:
    """A mean field and its sd field in one cell."""
    return Col(header or mean, lambda r: PM(r[mean], r.get(sd)) if mean in r else MISSING)


def first(header: str, *cols: Col) -> Col:
    """The first of several columns that the row has (rows of one table name a value differently)."""
    def get(r):
        for c in cols:
            v = c.get(r)
            if v is not MISSING:
                return v
        return MISSING
    return Col(header, get)


def ratio(num: str, den: str, header: str) -> Col:
    def get(r):
        a, b = r.get(num), r.get(den)
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else MISSING
    return Col(header, get)


def prefix(name: str, n: int, header: str | None = None) -> Col:
    return Col(header or name, lambda r: r[name][:n] if isinstance(r.get(name), str) else r.get(name, MISSING))


@dataclass(frozen=True)
class Table:
    """What one kind of row shows: the configuration (keys) and the measurements (values). The
    first value column is the one the earlier runs' lines give a range of."""
    keys: list[Col]
    values: list[Col]


@dataclass(frozen=True)
class Spec:
    tables: dict[str, Table]
    kind: Callable[[dict], str] = lambda r: ""
    notes: str = ""


def by_field(name: str, labels: dict | None = None) -> Callable[[dict], str]:
    labels = labels or {}
    return lambda r: labels.get(r.get(name), str(r.get(name)))


def one(keys: list, values: list) -> dict[str, Table]:
    cols = lambda xs: [x if isinstance(x, Col) else f(x) for x in xs]  # noqa: E731
    return {"": Table(cols(keys), cols(values))}


def T(keys: list, values: list) -> Table:
    return one(keys, values)[""]


SPECS: dict[str, Spec] = {
    "cache_hits": Spec(one(["model", "share", "layer", "slots", "every", "batch", "prompt", "len"],
                           ["cache", "uniform", "profiled", "oracle", "copied_per_token"])),
    "cache_prefill": Spec(one(["model", "share", "budget_gb", "tokens"],
                              ["static_tok_s", "static_cpu_tok_s", "cache_tok_s", "cache_cpu_tok_s",
                               ratio("cache_tok_s", "static_tok_s", "cache / static"), "cache_refill_ms"])),
    "cache_speed": Spec(one(["model", "device", "share", "seqs", "every"],
                            [pm("cache_tok_s", "cache_sd", "cache tok/s"),
                             pm("uniform_tok_s", "uniform_sd", "uniform tok/s"),
                             pm("profiled_tok_s", "profiled_sd", "profiled tok/s"),
                             pm("frozen_tok_s", "frozen_sd", "frozen tok/s"),
                             ratio("cache_tok_s", "uniform_tok_s", "cache / uniform"), "cache_hit",
                             "cache_hit_predicted", "copied_mb_per_token"])),
    "compile_scale": Spec(one(["model", "hw", "layers", "experts", "steps", "repeats"],
                              [pm("seconds_mean", "seconds_sd", "compile s")])),
    "copy_stall": Spec(one(["kind", "variant", "branch", "mb", "experts", "piece_mb"],
                           [pm("ms_per_token", "sd", "ms a token"), "added_ms_per_mb", "stall", "link_gbps",
                            "host_ms_per_token"])),
    "defer_speed": Spec(one(["model", "variant"],
                            [pm("decode_tok_s", "decode_tok_s_sd", "decode tok/s"), "vs_exact", "perplexity", "kl",
                             "top1_changed"])),
    "deferral_predicted": Spec(one(["model", "hw", "defer", "chosen"],
                                   ["step_ms", "layer_us", "gpu_busy", "cpu_busy", "overlap"]),
                               notes="Cost-model predictions, not measurements."),
    "e2e": Spec(
        kind=lambda r: "prefill" if r.get("table") == "prefill" else "decode",
        tables={
            "decode": T(["model", "layers", "checkpoint", first("expert format", f("expert_format"), f("gguf")),
                         first("variant", f("variant"), f("system"))],
                        [pm("decode_tok_s", "decode_sd", "decode tok/s"), "roofline_fraction", "cpu_busy",
                         "measured_layer_us", "predicted_layer_us", "peak_vram_gb"]),
            "prefill": T(["model", "layers", first("expert format", f("expert_format"), f("gguf")), "system", "prompt"],
                         [pm("tok_s", "sd", "tok/s"), "decisions", "pcie_bound_fraction", "measured_layer_us",
                          "predicted_layer_us", "peak_vram_gb"]),
        },
        notes="decode: ktflow's variants and llama.cpp's rows (system); prefill: both systems' prompt rates."),
    "fidelity": Spec(one(["model", "variant", "positions"], ["perplexity", "kl", "top1_changed"])),
    "fp8_linear": Spec(one(["shape", "n", "k", "m"],
                           ["fp8_vs_bf16", "bf16_us", "fp8_us", "fused_us", "dequant_mm_us", "fp8_gbps", "rel_err"])),
    "graph_nodes": Spec(one(["kind", "kernels", "nodes"], ["us_per_replay", "us_per_node"])),
    "greedy_runs": Spec(one(["model", "layers", "expert_format", "defer", "steps_per_launch"],
                            [pm("tok_s", "tok_s_sd", "tok/s"), "boundary_us", "between_us", "task_us"])),
    "moe_kernel": Spec(
        kind=by_field("bench", {"moe_kernel": "operator", "moe_kernel.kernel": "kernel ceiling (one thread)"}),
        tables={
            "operator": T(["shape", "impl", "T", "threads", "hugepages"],
                          ["us", "gbps", "dram_fraction", "op_dram_fraction", "tflops", "dram_gbps"]),
            "kernel ceiling (one thread)": T(["shape", "path", "fmt", "rows", "n"], ["tflops_per_thread"]),
        }),
    "placement_hits": Spec(one(["model", "share", "layer", "gpu_experts"],
                               ["profiled", "expected", "uniform", "best"])),
    "prefetch_hits": Spec(one(["model", "layer", "top_k", "m"], ["pre_gate", "last_token", "profile", "chance"])),
    "prefix_cache": Spec(one(["model", "layers", "checkpoint", "vram_gb", "turns", "grow", "answer", "step",
                              "prefix_cache"], ["total_ttft_s"]),
                         notes="total time to first token over the conversation; the target: reuse <= 0.2x whole."),
    "sampled_decode": Spec(one(["model", "layers", "variant"],
                               [pm("tok_s", "sd", "tok/s"), "vs_greedy1", "vs_greedy8", "us_per_replay"])),
    "speculative": Spec(one(["model", "hw", "compiler_k", "plan", "k", "selection"],
                            ["tok_s", "gain", "predicted_gain", "drafts_kept", "same_ids"]),
                        notes="gain and predicted_gain against plain decoding of the same selection in the same run; "
                              "drafts_kept: drafts kept a verification step; same_ids: greedy tokens equal plain "
                              "decoding's."),
    "structured_decode": Spec(one(["model", "layers", "checkpoint", "vocab", "kind", "requests"],
                                  ["mean_tokens", "decode_tok_s", "ratio_vs_free", "valid"]),
                              notes="kind free: unconstrained greedy; schema: a JSON schema; tool: tool_choice "
                                    "required (valid: answers that parse as a call of a declared tool)."),
    "serve_load": Spec(
        kind=by_field("bench"),
        tables={
            "serve_load": T(["model", "experts_on_cpu", "streams", "prompt_tokens", "max_tokens"],
                            ["total_tok_s", "per_stream_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms",
                             "ttft_p99_ms", "errors"]),
            "serve_load_long_prompt": T(["model", "streams", "long_prompt"],
                                        ["long_ttft_ms", "itl_during_p50_ms", "itl_during_p99_ms", "errors"]),
            "serve_load_soak": T(["model", "streams", "server_slots", "chaos"],
                                 ["soak_s", "tokens", "rss_slope_mb_per_min", "vram_reserved_slope_mb_per_min",
                                  "vram_allocated_slope_mb_per_min", "open_fds_max", "errors", "hostile_5xx"]),
        }),
    "train_small_moe": Spec(one(["size", "device", "seed", "steps"],
                                ["heldout_perplexity", "final_loss", "train_seconds",
                                 prefix("weights_sha256", 12, "weights sha256")])),
    "user_configs": Spec(one(["model", "layers", "vram_gb", "table", first("variant", f("variant"), f("system")),
                              "prompt", "decode_depth"],
                             [first("tok/s", pm("tok_s", "sd"), pm("decode_tok_s", "decode_sd"),
                                    f("sampled_estimate_tok_s")),
                              "gpu_experts", "predicted_gb", "max_allocated_gb", "process_gb",
                              f("llama_commit", "llama.cpp commit"), "error"]),
                         notes="One run id per session's run; `benchmarks/user_report.py --run-id ID` gives a "
                               "run's targets."),
}

# Fields every benchmark records about where and when, not what: never a generic column.
COMMON = {"bench", "commit", "machine", "cpu", "gpu", "hugepages", "run_id", "ktflow", "note", "device",
          "date", "time", "timestamp"}
DATE_FIELDS = ("date", "timestamp", "time")


def generic(rows: list[dict]) -> Spec:
    """Scalar fields that at least half the rows carry, in the order they first appear, at most 10;
    numbers other than integers are the measurements."""
    order: dict[str, int] = {}
    for r in rows:
        for k, v in r.items():
            if k not in COMMON and (v is None or isinstance(v, (bool, int, float, str))):
                order[k] = order.get(k, 0) + 1
    names = [k for k, n in order.items() if 2 * n >= len(rows)][:10]
    is_value = lambda k: any(isinstance(r.get(k), float) for r in rows)  # noqa: E731
    return Spec(one([k for k in names if not is_value(k)], [k for k in names if is_value(k)]))


# --------------------------------------------------------------------------------------- formatting

def short_commit(c: Any) -> str:
    if not isinstance(c, str):
        return "?" if c is None else str(c)
    m = re.fullmatch(r"([0-9a-f]{7,40})(.*)", c)
    return (m.group(1)[:7] + m.group(2)) if m else c


def num(x: float | int, sig: int = 4) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if 1e4 <= abs(x) < 1e7:
        return f"{x:.0f}"
    return f"{x:.{sig}g}"


def cell(v: Any) -> str:
    if v is MISSING:
        return ""
    if v is None:
        return "—"
    if isinstance(v, PM):
        if not isinstance(v.mean, (int, float)):
            return cell(v.mean)
        return num(v.mean) + (f" ± {num(v.sd, 3)}" if isinstance(v.sd, (int, float)) and not isinstance(v.sd, bool)
                              else "")
    if isinstance(v, (bool, int, float)):
        return num(v)
    s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), sort_keys=True)
    s = " ".join(s.split())
    if len(s) > MAX_STR:
        s = s[:MAX_STR - 1] + "…"
    return s.replace("|", "\\|")


def numeric(v: Any) -> float | None:
    if isinstance(v, PM):
        v = v.mean
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def md_table(headers: list[str], rows: list[list[str]], right: list[bool]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# ------------------------------------------------------------------------------------------ reading

def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultsError(f"{path}:{n}: malformed JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise ResultsError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def describe(bench_dir: Path, stem: str) -> str:
    """The first sentence of the benchmark program's module docstring (read, not imported)."""
    src = bench_dir / f"{stem}.py"
    try:
        doc = ast.get_docstring(ast.parse(src.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, ValueError):
        doc = None
    if not doc:
        return f"(no module docstring in `{stem}.py`)"
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.search(r"(?<=\.)\s+(?=[A-Z`(])", para)
    return para[:m.start()] if m else para


def machine_of(r: dict) -> tuple[str, str]:
    """(sort key, title): the GPU where the row names one, else its CPU and host."""
    gpu, cpu, host = r.get("gpu"), r.get("cpu"), r.get("machine")
    if gpu:
        return ("0 " + str(gpu), str(gpu))
    if cpu or host:
        where = f"CPU {cpu or 'not recorded'}" + (f", host `{host}`" if host else "")
        return ("1 " + where, where + " (no GPU named in the rows)")
    return ("2", "machine not recorded")


def run_of(r: dict) -> str:
    return str(r["run_id"]) if r.get("run_id") else short_commit(r.get("commit"))


# ---------------------------------------------------------------------------------------- rendering

@dataclass
class Shown:
    cols: list[Col]
    rows: list[list[Any]]  # values per column
    counts: list[int] | None = None  # rows merged into each shown row
    lifted: list[tuple[str, Any]] = field(default_factory=list)


def base_cols(rows: list[dict]) -> list[Col]:
    cols = [Col("commit", lambda r: short_commit(r.get("commit")))]
    if any(r.get("run_id") for r in rows):
        cols.insert(0, f("run_id", "run"))
    for d in DATE_FIELDS:
        if any(d in r for r in rows):
            cols.insert(0, f(d))
            break
    return cols


def aggregate(rows: list[dict], front: list[Col], table: Table) -> tuple[list[list[Any]], list[int]]:
    """One line per configuration (the front and key columns): the median of each measurement."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = tuple(cell(c.get(r)) for c in front + table.keys)
        groups.setdefault(key, []).append(r)
    out, counts = [], []
    for rs in groups.values():
        line = [c.get(rs[0]) for c in front + table.keys]
        for c in table.values:
            vs = [c.get(r) for r in rs]
            nums = [numeric(v) for v in vs]
            if all(x is not None for x in nums):
                line.append(statistics.median(nums))
            else:
                distinct = {cell(v) for v in vs}
                line.append(vs[0] if len(distinct) == 1 else "varies")
        out.append(line)
        counts.append(len(rs))
    return out, counts


def shown(rows: list[dict], table: Table) -> Shown:
    front = base_cols(rows)
    if len(rows) <= MAX_ROWS:
        cols = front + table.keys + table.values
        return Shown(cols, [[c.get(r) for c in cols] for r in rows])
    values, counts = aggregate(rows, front, table)
    if len(values) == len(rows):  # nothing to merge: every row a configuration of its own
        cols = front + table.keys + table.values
        return Shown(cols, [[c.get(r) for c in cols] for r in rows])
    return Shown(front + table.keys + table.values, values, counts)


def tidy(s: Shown, n_front: int) -> Shown:
    """Drop columns no row has; give a column once above the table when every row has the same value."""
    keep, lifted = [], []
    for i, c in enumerate(s.cols):
        vals = [row[i] for row in s.rows]
        if all(v is MISSING for v in vals):
            continue
        if i >= n_front and len(vals) > 1 and len({cell(v) for v in vals}) == 1 and vals[0] is not MISSING:
            lifted.append((c.header, vals[0]))
            continue
        keep.append(i)
    return Shown([s.cols[i] for i in keep], [[row[i] for i in keep] for row in s.rows], s.counts, lifted)


def render_table(stem: str, rows: list[dict], table: Table) -> list[str]:
    out: list[str] = []
    runs: dict[str, list[dict]] = {}
    for r in rows:
        runs.setdefault(run_of(r), []).append(r)
    latest = run_of(rows[-1])
    if len(rows) > MAX_ROWS and len(runs) > 1:
        body = runs[latest]
        earlier = {k: v for k, v in runs.items() if k != latest}
        out.append(f"{len(rows)} rows in {len(runs)} runs; the latest run ({latest}, {len(body)} rows) below, "
                   f"{len(rows) - len(body)} rows of {len(earlier)} earlier runs after it.")
        out.append("")
    else:
        body, earlier = rows, {}
    s = shown(body, table)
    n_front = len(base_cols(body))
    if s.counts is not None:
        s.cols.insert(n_front + len(table.keys), Col("merged", lambda r: MISSING))
        for row, n in zip(s.rows, s.counts):
            row.insert(n_front + len(table.keys), n)
        out.append(f"{len(body)} rows, more than {MAX_ROWS}: one line per configuration, each measurement the "
                   f"median of the rows merged.")
        out.append("")
    s = tidy(s, n_front)
    if s.lifted:
        out.append("In every row: " + "; ".join(f"{h} {cell(v)}" for h, v in s.lifted) + ".")
        out.append("")
    right = [any(numeric(row[i]) is not None for row in s.rows) for i in range(len(s.cols))]
    out += md_table([c.header for c in s.cols], [[cell(v) for v in row] for row in s.rows], right)
    if earlier:
        head = table.values[0] if table.values else None
        lines = []
        for run, rs in earlier.items():
            vals = [x for x in (numeric(head.get(r)) for r in rs) if x is not None] if head else []
            span = "" if not vals else (num(min(vals)) if min(vals) == max(vals)
                                        else f"{num(min(vals))} – {num(max(vals))}")
            commits = ", ".join(dict.fromkeys(short_commit(r.get("commit")) for r in rs))
            lines.append([run, commits, str(len(rs)), span])
        hdr = ["earlier run", "commit", "rows", f"{head.header if head else 'value'}: min – max"]
        if all(line[0] == line[1] for line in lines):
            hdr, lines = hdr[1:], [line[1:] for line in lines]
        out += ["", f"Earlier runs (every row is in `{stem}.jsonl`):", ""]
        out += md_table(hdr, lines, [False] * (len(hdr) - 2) + [True, True])
    return out


def render(bench_dir: Path) -> str:
    bench_dir = Path(bench_dir)
    files = sorted(bench_dir.glob("*.jsonl"))
    data = {p.stem: read_jsonl(p) for p in files}
    summary_path = bench_dir / "SUMMARY.md"
    summary = summary_path.read_text(encoding="utf-8").rstrip("\n") if summary_path.exists() else \
        "_No benchmarks/SUMMARY.md._"
    out = [
        "# Benchmark results",
        "",
        f"<!-- Generated by `{COMMAND}` ({SCRIPT}) from benchmarks/*.jsonl and benchmarks/SUMMARY.md. "
        "Do not edit by hand: tests/test_results.py fails when this file differs from what the script writes. -->",
        "",
        f"**Generated: do not edit by hand.** `{COMMAND}` (`.venv/bin/python {SCRIPT}`) writes this file from "
        "the rows the benchmarks append to `benchmarks/*.jsonl`, after the hand-written summary, which is "
        "`benchmarks/SUMMARY.md` copied verbatim (edit that file, then regenerate). The narrative log of the "
        "sessions up to 44 (what each run was, why, and what it showed) is `docs/results-history.md`.",
        "",
        "How to read the tables:",
        "",
        "- One section per benchmark (the JSONL file's stem; its line is the first sentence of the "
        "benchmark program's docstring), one subsection per machine: the GPU the rows name, else the CPU "
        "model and host name they record. Where a file holds rows of several kinds, one table per kind.",
        "- Every row carries its commit (`+dirty`: the tree had uncommitted changes; other suffixes as the "
        "run recorded them) and its run id where the benchmark records one. The rows record no dates; "
        "rows are in the order they were appended.",
        "- Columns are chosen per benchmark in `benchmarks/results.py` (`SPECS`); a benchmark not listed "
        "there shows the scalar fields that most of its rows carry (at most 10). A column with the same "
        "value in every row of a table is given once above it (\"In every row\"). Empty cell: the row lacks "
        "the field; \"—\": it recorded null.",
        "- Numbers: 4 significant digits (whole numbers from 10^4 to 10^7); \"a ± b\" is a mean and its sd "
        "(3 significant digits) as the row recorded them; yes/no are booleans.",
        f"- Large tables: a table of more than {MAX_ROWS} rows shows its latest run row by row (a run: one run "
        "id, else one commit; the latest: the run of the table's last row) and then one line per earlier run: "
        "its row count and the range of its first measurement column. When the latest run alone has more "
        f"than {MAX_ROWS} rows and some of them repeat a configuration, they are merged into one line per "
        "configuration (column \"merged\": how many), each measurement the median of the rows merged. "
        "Every row stays in the JSONL files.",
        "",
        summary,
        "",
        "## Benchmarks",
        "",
    ]
    index = []
    for stem, rows in data.items():
        machines = sorted({machine_of(r) for r in rows})
        latest = short_commit(rows[-1].get("commit")) if rows else ""
        index.append([f"[{stem}](#{stem})", str(len(rows)), str(len(machines)), latest])
    out += md_table(["benchmark", "rows", "machines", "last row's commit"], index, [False, True, True, False])
    for stem, rows in data.items():
        spec = SPECS.get(stem) or generic(rows)
        out += ["", f"## {stem}", "", f"{describe(bench_dir, stem)} (`benchmarks/{stem}.py`; "
                f"{len(rows)} rows in `benchmarks/{stem}.jsonl`{'' if stem in SPECS else '; generic columns'})"]
        if spec.notes:
            out += ["", spec.notes]
        if not rows:
            out += ["", "No rows."]
            continue
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in rows:
            groups.setdefault(machine_of(r), []).append(r)
        for (_, title), mrows in sorted(groups.items()):
            out += ["", f"### {stem}: {title}"]
            kinds: dict[str, list[dict]] = {}
            for r in mrows:
                kinds.setdefault(spec.kind(r), []).append(r)
            order = [k for k in spec.tables if k in kinds] + sorted(k for k in kinds if k not in spec.tables)
            for k in order:
                table = spec.tables.get(k) or generic(kinds[k]).tables[""]
                if len(kinds) > 1 or k not in spec.tables:
                    out += ["", f"#### {stem}: {title}: {k or 'other rows'}"]
                out += [""] + render_table(stem, kinds[k], table)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-dir", type=Path, default=HERE, help="folder of the *.jsonl files (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="output file (default: BENCH_DIR/RESULTS.md)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the output file differs; write nothing")
    a = ap.parse_args(argv)
    out = a.out or a.bench_dir / "RESULTS.md"
    try:
        text = render(a.bench_dir)
    except ResultsError as e:
        print(f"results.py: error: {e}", file=sys.stderr)
        return 2
    if a.check:
        same = out.exists() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'up to date' if same else 'differs from the rows; run `' + COMMAND + '`'}")
        return 0 if same else 1
    write_atomic(out, text)
    print(f"wrote {out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
