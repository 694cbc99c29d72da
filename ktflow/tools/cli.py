"""The `ktflow` command line: compile, run, serve, inspect, demo."""

from __future__ import annotations

import argparse
import os
import sys

from ..serve.tool_parsers import PARSERS
from ..util import env
from .compile_flags import add_compile_options
from .commands import (add_record_option, cmd_calibrate, cmd_compile, cmd_demo, cmd_diff,
                       cmd_hw_probe, cmd_hw_show, cmd_inspect, cmd_profile, cmd_run, cmd_serve)

EPILOG = """examples:
  ktflow demo                                   small DeepSeek-V3-shaped model, compiled and run
  ktflow compile ./DeepSeek-V3 -o v3.plan.json  compile (config.json alone is enough)
  ktflow compile ./DeepSeek-V3 --hw paper-a100 --explain     where each node runs, and why (prefill buckets too)
  ktflow compile ./model --prefill-experts stream --prefill-buckets 2048,32768   force streamed experts
  ktflow compile ./model --print-after place_by_intensity
  ktflow run ./model --input-ids "1 2 3" --max-new-tokens 16
  ktflow run ./model --prompt "Hello" --temperature 0.7 --top-p 0.9 --seed 1
  ktflow inspect v3.plan.json --text
  ktflow hw show paper-a100                     a hardware preset; `ktflow hw probe -o me.json` measures this one
  ktflow calibrate ./model -o me.json           fit the profile to this machine's measured decode step
  ktflow serve ./model --port 8000              an OpenAI-compatible HTTP server (needs tokenizer.json)
  ktflow profile ./model --prompts p.txt -o routing.json   record routing; compile --routing-profile reads it
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `ktflow compile: error: <what> (see ktflow compile
    --help)`, exit 2 (the default prints the whole usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from ktflow.passes import pass_names
    from ktflow.version import __version__

    p = _Parser(prog="ktflow", description="Compile and run huge MoE models on one GPU + big-CPU "
                                "workstation.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ktflow {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, the Python traceback too (or KTFLOW_DEBUG=1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal anyway; or "
                   "KTFLOW_QUIET=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a model into a plan file",
                       description="Run the pass pipeline for a model (an HF checkpoint dir; config.json alone is "
                       "enough) and print the plan summary.")
    c.add_argument("model", help="HF checkpoint dir (config.json [+ *.safetensors])")
    c.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    c.add_argument("--print-after", metavar="PASS", help=f"print the graph after this pass ({', '.join(pass_names())})")
    c.add_argument("--text", action="store_true", help="also print both plans in full")
    c.add_argument("--explain", action="store_true", help="print where each node runs and why, the prefill buckets, "
                   "and the VRAM plan: what the prefill reservation costs decode and buys prefill, against the "
                   "candidates the cost model priced")
    c.add_argument("--trace", metavar="JSON", help="write the predicted timelines as a Chrome trace (open in Perfetto)")
    c.add_argument("--report", metavar="HTML", help="write an HTML report: memory, per-layer timeline, placement")
    c.add_argument("--routing-profile", metavar="JSON", help="per-layer expert frequencies: hot experts go to the GPU")
    add_compile_options(c)
    c.set_defaults(fn=cmd_compile)

    r = sub.add_parser("run", help="generate tokens with a model",
                       description="Prefill a prompt, decode new tokens, print them and the prefill/decode speed.")
    r.add_argument("model", help="HF checkpoint dir with weights")
    r.add_argument("--input-ids", help='prompt token ids, e.g. "1 2 3"')
    r.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model dir)")
    r.add_argument("--plan", help="use this compiled plan file instead of compiling")
    r.add_argument("--max-new-tokens", type=int, default=32)
    s = r.add_argument_group("token selection", "made on the device that computes the logits (inside the captured "
                             "decode step on a GPU); the defaults are greedy")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens holding this share of the mass")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: no limit)")
    s.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share of the most likely's "
                   "probability")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="divide (x > 0) or multiply the logits of "
                   "tokens in the prompt or generated by this (1: none)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from each generated token's logit")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times each generated token's "
                   "count")
    s.add_argument("--seed", type=int, default=None, help="seed of the random stream (default: a random one)")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos token")
    r.add_argument("--check-finite", action="store_true", help="check every step's values for NaN and infinity and "
                   "name the first node that made one (slower; KTFLOW_CHECK_FINITE=1 does the same)")
    add_record_option(r)
    r.add_argument("--trace", metavar="JSON", help="run the prompt step and the first decode step instrumented "
                   "(CUDA events per GPU instruction, the CPU queue's timestamps) and write their measured timelines "
                   "as a Chrome trace, in the format of `ktflow compile --trace`")
    add_compile_options(r)
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("inspect", help="print a plan file's summary", description="Print a plan file's summary.")
    i.add_argument("plan", help="plan JSON written by `ktflow compile -o`")
    i.add_argument("--text", action="store_true", help="print both plans in full (graph and instructions)")
    i.set_defaults(fn=cmd_inspect)

    df = sub.add_parser("diff", help="what changed between two plan files",
                        description="What changed from plan A to plan B: options and pipeline, then per plan "
                        "(decode, prefill buckets): predicted step time, memory per device, Expert Deferral per "
                        "layer, nodes placed elsewhere (with B's cause), per-layer predicted times.")
    df.add_argument("a", help="plan JSON (before)")
    df.add_argument("b", help="plan JSON (after)")
    df.set_defaults(fn=cmd_diff)

    d = sub.add_parser("demo", help="write, compile and run a small DeepSeek-V3-shaped model",
                       description="Write a small random-weight DeepSeek-V3-shaped checkpoint into the cache dir "
                       "(once), compile it and generate tokens. Needs no network.")
    d.add_argument("--dir", help="checkpoint dir (default: <cache>/demo-deepseek-v3)")
    d.add_argument("--hw", default=None, help="hardware profile (default: this machine)")
    d.add_argument("--prompt-tokens", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.set_defaults(fn=cmd_demo)
    h = sub.add_parser("hw", help="hardware profiles: show presets, measure this machine",
                       description="Hardware profiles tell the compiler what the machine can do.")
    hsub = h.add_subparsers(dest="hw_command", required=True, metavar="HW_COMMAND")
    hs = hsub.add_parser("show", help="list presets, or print one profile",
                         description="Without an argument, list the presets; with one, print that profile.")
    hs.add_argument("profile", nargs="?", help="a preset, 'this', or a profile JSON path")
    hs.set_defaults(fn=cmd_hw_show)
    hp = hsub.add_parser("probe", help="measure this machine and write a profile JSON",
                         description="Measure DRAM bandwidth, CPU bf16 GEMM/GEMV and, with a GPU, its HBM "
                         "bandwidth, bf16 GEMM, PCIe both ways and launch overhead (about a minute).")
    hp.add_argument("-o", "--output", help="write the profile JSON here (atomically)")
    hp.add_argument("--name", help="profile name (default 'probed')")
    hp.add_argument("--quick", action="store_true",
                    help="fewer repeats and smaller CPU compute sizes: seconds instead of a minute, lower CPU FLOP "
                    "rates (bandwidths still read past the caches; GPU rates at full size)")
    hp.set_defaults(fn=cmd_hw_probe)
    cal = sub.add_parser("calibrate", help="fit a hardware profile to a model's measured decode step",
                         description="Compile MODEL for --hw, run its decode plan here with the measured trace, "
                         "fit what the roofline misses (the GPU's efficiency and fixed time per op, the CPU's rate "
                         "and fixed time per op, the CPU task hand-off each way: ktflow.tools.calibrate) and write the "
                         "profile, which later compiles use with --hw PROFILE.json. On a GPU with CPU experts the "
                         "exact plan is measured first, then the plan deferring --defer picks a layer (2 when "
                         "--defer is not a number), for the deferred task's extra time.")
    cal.add_argument("model", help="HF checkpoint dir with weights")
    cal.add_argument("-o", "--output", help="write the fitted profile JSON here (atomically)")
    cal.add_argument("--steps", type=int, default=3, help="traced decode steps (the median of each op is fitted)")
    add_compile_options(cal)
    cal.set_defaults(fn=cmd_calibrate)
    pr = sub.add_parser("profile", help="record which experts a model's routers pick on some prompts",
                        description="Run each prompt of --prompts (one per line, tokenized with the checkpoint's "
                        "tokenizer.json) through MODEL, then --decode greedy tokens after it, counting per MoE layer "
                        "how often each expert is picked (and with --pairs each pair of experts together), and "
                        "write the routing profile JSON that `ktflow compile --routing-profile` places hot experts "
                        "by. The counters live on the device each router runs on; on the cuda_graph backend the captured decode "
                        "step adds to them as it replays.")
    pr.add_argument("model", help="HF checkpoint dir with weights and tokenizer.json")
    pr.add_argument("--prompts", required=True, help="text file, one prompt per line")
    pr.add_argument("-o", "--output", required=True, help="routing profile JSON to write (atomically)")
    pr.add_argument("--decode", type=int, default=128,
                    help="greedy tokens decoded after each prompt (default 128): the expert cache's curves replay its "
                    "refills on them (every 8..64 tokens), so the placement pass can price a cache")
    pr.add_argument("--pairs", action="store_true",
                    help="also count pairs of experts picked by one token (experts^2 numbers per layer)")
    add_compile_options(pr)
    pr.add_argument("--mtp", action="store_true", help="also measure how often the checkpoint's multi-token-prediction "
                    "layer's chained greedy drafts equal the model's greedy tokens, by depth, on each prompt's "
                    "--decode continuation (the acceptance rates `compile --speculate auto` prices speculative "
                    "decoding by); needs an eager backend (--backend native or torch_ref)")
    pr.set_defaults(fn=cmd_profile)
    sv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Compile MODEL (or load --plan) and serve it over HTTP with the OpenAI API:\n"
                        "  POST /v1/chat/completions, /v1/completions  (\"stream\": true for server-sent events)\n"
                        "  GET  /v1/models, /health, /metrics           (/metrics: Prometheus text format)\n"
                        "  POST /tokenize, /detokenize                  (a prompt's or messages' ids; ids to text)\n"
                        "Up to --max-batch sequences run at once, each in its own slot, decoded together in one\n"
                        "batched step per token; new ones join between tokens (continuous batching), prompts that\n"
                        "arrive together are prefilled in one step, up to --max-queue wait, past that 429.\n"
                        "SIGTERM stops admitting, lets requests in flight finish (--shutdown-timeout), exits 0.",
                        epilog="""examples:
  ktflow serve ./model --hw this --port 8000
  ktflow serve ./model --plan model.plan.json --max-batch 8 --api-key $KEY
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'

MODEL must hold tokenizer.json (and tokenizer_config.json with a chat_template for the chat endpoint).""")
    sv.add_argument("model", help="HF checkpoint dir with weights and tokenizer.json")
    sv.add_argument("--plan", help="use this compiled plan file instead of compiling")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                    "0.0.0.0 for every interface, which needs --api-key or --insecure-no-auth)")
    sv.add_argument("--insecure-no-auth", action="store_true",
                    help="serve a non-loopback --host without an API key (anyone who reaches the port may use it)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument("--model-name", default=None, help="the model name clients send (default: MODEL's dir name)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for a slot; more get HTTP 429 with Retry-After (default 64)")
    sv.add_argument("--api-key", default=env.get("KTFLOW_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $KTFLOW_API_KEY; none: open)")
    sv.add_argument("--prefill-step", type=int, default=None, metavar="TOKENS",
                    help="most prompt tokens prefilled per scheduler iteration (the chunks of every waiting prompt "
                    "that fit, in one packed step), so a long prompt delays running sequences by one such chunk "
                    "per token (default: min(256, the largest prefill bucket))")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                    help="on SIGTERM, seconds requests in flight get to finish before they are cancelled (default 30)")
    sv.add_argument("--step-timeout", type=float, default=600.0, metavar="S",
                    help="a model step running longer than this is stuck: its requests fail and /health says 503 "
                    "until it returns (default 600)")
    sv.add_argument("--max-connections", type=int, default=512, metavar="N",
                    help="connections served at once; more get HTTP 503 (default 512; the open-file limit is raised "
                    "to its hard limit at start)")
    sv.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                    help="seconds an idle keep-alive connection stays open (default 5)")
    sv.add_argument("--request-timeout", type=float, default=30.0, metavar="S",
                    help="seconds a client gets to send a request's headers (from connecting, or from the first "
                    "byte of its next request) and again its body; past either, HTTP 408 (default 30)")
    sv.add_argument("--tool-parser", default=None, choices=sorted(PARSERS),
                    help="how the model writes tool calls (default: its family's: hermes for Qwen2/Qwen3 MoE, "
                    "deepseek_v3 for DeepSeek-V3/R1/V3.1, glm45 for GLM-4.5, kimi_k2 for Kimi-K2; families "
                    "without one refuse requests with tools)")
    sv.add_argument("--reasoning-parser", default=None, choices=["think"],
                    help="split a reasoning model's <think>...</think> from its answer into reasoning_content "
                    "(DeepSeek-R1, Qwen3 thinking; default: the thinking stays in content)")
    sv.add_argument("--chat-template", default=None, metavar="FILE",
                    help="a jinja chat template file to use instead of the checkpoint's")
    sv.add_argument("--special-tokens-in-messages", action="store_true",
                    help="let a special token's text inside a chat message become that token (default: only the "
                    "chat template makes special tokens; a user's '<|im_end|>' stays text)")
    sv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="prefill every prompt whole (default: a request reuses the KV entries a free slot holds "
                    "for its prompt's first tokens, as an agent's or a chat's next turn does, and prefills the rest; "
                    "the answers may differ from a whole prefill's in rounding)")
    sv.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                    help="largest request body read; a larger one gets HTTP 413 (default 16)")
    add_record_option(sv)
    add_compile_options(sv)
    sv.set_defaults(fn=cmd_serve, max_batch=4)
    for act in sv._actions:
        if act.dest == "max_batch":
            act.help = "sequences served at once, each with its own KV cache slot, decoded together in one batched " \
                       "step (default 4); also the batch the compiled plan's memory is planned for (a --plan must " \
                       "have been compiled with max_batch at least this)"
    for sp in [*sub.choices.values(), *hsub.choices.values()]:  # also after the command: `ktflow run ... --debug`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, the Python traceback too (or KTFLOW_DEBUG=1)")
        sp.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """The error boundary: every failure ends in one line on stderr and an exit code (see
    ktflow.errors): 2 bad input, 1 the environment or an internal error, 130 Ctrl-C, 141 a
    closed output pipe (quiet). --debug (or KTFLOW_DEBUG=1) re-raises for the traceback."""
    try:
        args = parser().parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted("ktflow")
    debug = bool(getattr(args, "debug", False)) or env.get("KTFLOW_DEBUG")
    where = f"ktflow {args.command}"
    if getattr(args, "quiet", False):
        from ktflow.util import progress

        progress.QUIET = True
    try:
        _check_paths(args)
        return args.fn(args)
    except BrokenPipeError:  # `ktflow inspect plan --text | head`: the reader is gone, say nothing
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        if debug:
            raise
        return _interrupted(where)
    except Exception as e:  # noqa: BLE001 - the boundary: one line for anything, the traceback on request
        if debug:
            raise
        code, message = describe(e)
        print(f"{where}: error: {message}", file=sys.stderr)
        return code


#: set by the console entry point: after an interrupt the process ends at once (its finally blocks
#: have run; library teardown that a late signal could break does not)
EXIT_AT_ONCE = False


def _interrupted(where: str) -> int:
    print(f"\n{where}: interrupted", file=sys.stderr)
    if EXIT_AT_ONCE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 130


#: the options that name a file to write
OUTPUT_OPTIONS = {"output": "--output", "trace": "--trace", "report": "--report", "record_routing": "--record-routing"}


def _check_paths(args: argparse.Namespace) -> None:
    """An output option given as an empty string is bad input, not a request for no output."""
    from ktflow.errors import ConfigError

    for dest, flag in OUTPUT_OPTIONS.items():
        if getattr(args, dest, None) == "":
            raise ConfigError(f"{flag} is empty: give a file path to write")


def describe(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached the CLI."""
    from ktflow.errors import KtflowError, first_line

    if isinstance(e, KtflowError):
        return e.exit_code, str(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
            isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        first = first_line(e) or "host memory"
        return 1, f"out of memory ({first}); use a smaller --vram-gb, --max-seq-len or --max-batch"
    if isinstance(e, OSError):
        what = f" {e.filename}" if e.filename else ""
        reason = e.strerror or str(e) or type(e).__name__
        return 1, f"{reason}:{what}" if what else reason
    text = first_line(e)
    return 1, (f"internal error: {type(e).__name__}{': ' + text if text else ''} (a bug in ktflow: rerun with "
               "--debug for the traceback and report it)")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
