"""`ktflow compile --report out.html`: one self-contained page per compile (jinja2): the memory
budget, the per-layer predicted timeline of each plan, the deferral choices and the placement
table with causes."""

from __future__ import annotations

import jinja2

from ..util.fsutil import write_atomic
from ..ir.types import _si
from .artifact import PlanFile, prefill_decisions
from .timeline import layer_times, step_utilisation

TEMPLATE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ktflow plan: {{ pf.model.model_type }} on {{ pf.hw.name }}</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 2em; color: #222 }
table { border-collapse: collapse; margin: 1em 0 } td, th { padding: 2px 8px; border-bottom: 1px solid #ddd;
text-align: left; vertical-align: top } th { background: #f4f4f4 } td.num { text-align: right }
.gpu { color: #2a7a2a } .cpu { color: #1f4fa8 } .bar { height: 10px; display: inline-block }
.bgpu { background: #5cb85c } .bcpu { background: #428bca } .bcopy { background: #f0ad4e }
code { background: #f4f4f4; padding: 0 3px }
</style></head><body>
<h1>{{ pf.model.model_type }}, {{ pf.model.layers }} layers, on {{ pf.hw.name }}</h1>
<p>ktflow {{ pf.ktflow_version }} (plan format {{ pf.format_version }}); model fingerprint
<code>{{ pf.model.fingerprint }}</code>; {{ pf.hw.description }}</p>
<pre>{{ pf.hw.summary() }}</pre>
<p>Options: {% for k, v in pf.options.model_dump().items() %}<code>{{ k }}={{ v }}</code> {% endfor %}</p>

<h2>Memory</h2>
<table><tr><th>plan</th><th>peak VRAM</th><th>host RAM</th><th>all weights</th><th>KV cache</th><th>activations</th><th>staging</th></tr>
{% for p in plans %}<tr><td>{{ p.phase }}{% if p.phase == "prefill" %} (up to {{ p.step_tokens }} tokens){% endif %}</td>
<td class="num">{{ gb(p.memory.gpu_bytes) }}</td>
<td class="num">{{ gb(p.memory.host_bytes) }}</td><td class="num">{{ gb(p.memory.weight_bytes) }}</td>
<td class="num">{{ gb(p.memory.kv_cache_bytes) }}</td><td class="num">{{ gb(p.memory.activation_bytes) }}</td>
<td class="num">{{ gb(p.memory.staging_bytes) }}</td></tr>
{% endfor %}</table>

{% if pf.vram %}{% set v = pf.vram %}
<h2>VRAM plan: decode residency against prefill</h2>
<p>Limit {{ gb(v.limit_bytes) }} ({{ v.limit_cause }}); workload {{ v.workload }}. Chose <b>{{ v.chosen }}</b>:
prefill reservation {{ gb(v.reserved_bytes) }} (steps up to {{ v.chunk_tokens }} tokens, staging {{ v.stage_experts }}
experts a staging buffer), decode residency {{ gb(v.residency_bytes) }}, BLAS workspaces {{ gb(v.workspace_bytes) }}.
Decode step {{ "%.2f"|format(v.decode_us / 1000) }} ms against {{ "%.2f"|format(v.decode_us_without / 1000) }} ms
decode first ({{ "%+.1f"|format(100 * v.decode_cost) }}%); prefill of {{ v.prompts|join("/") }} tokens
{{ v.rates(v.prefill_s) }} tokens/s against {{ v.rates(v.prefill_s_without) }}. Predicted; <code>benchmarks/vram_plan.py</code> measures
them on the GPU.</p>
<table><tr><th>candidate</th><th>design</th><th>reserve</th><th>decode step</th><th>prefill tokens/s ({{ v.prompts|join("/") }})</th>
<th>request</th><th></th></tr>
{% for c in v.candidates %}<tr><td>{% if c.name == v.chosen %}<b>{{ c.name }}</b>{% else %}{{ c.name }}{% endif %}</td>
<td>{{ c.design }}</td><td class="num">{{ gb(c.reserved_bytes) }}</td>
<td class="num">{{ "%.2f"|format(c.decode_us / 1000) }} ms</td>
<td class="num">{{ v.rates(c.prompt_s) }}</td>
<td class="num">{% if c.prefill_s %}{{ "%.2f"|format(c.request_s) }} s{% else %}-{% endif %}</td>
<td>{% if c.extra_s %}copy-back {{ "%.3f"|format(c.extra_s) }} s a prompt; {% endif %}{{ c.note }}</td></tr>
{% endfor %}</table>
<p>{{ v.cause }}</p>
{% endif %}

<h2>Prefill buckets: where the routed experts compute</h2>
<table><tr><th>bucket (tokens per step)</th><th>predicted step</th><th>tokens/s</th><th>routed experts per layer</th></tr>
{% for p in pf.prefill %}<tr><td class="num">{{ p.step_tokens }}</td><td class="num">{{ "%.3f"|format(p.predicted_step_us / 1000) }} ms</td>
<td class="num">{{ "%.0f"|format(p.step_tokens / p.predicted_step_us * 1e6 if p.predicted_step_us else 0) }}</td>
<td>{{ decisions(p) }}</td></tr>
{% endfor %}</table>
<p>Longer prompts run as chunks of {{ pf.prefill[-1].step_tokens }} tokens. The causes of each decision are in the
placement tables below.</p>

{% for p in plans %}
<h2>{{ p.phase }} plan: predicted {{ "%.3f"|format(p.predicted_step_us / 1000) }} ms per {{ p.step_tokens }}-token step</h2>
<p>Lanes busy: {% for lane, f in util(p).items() %}<code>{{ lane }} {{ "%.0f"|format(100 * f) }}%</code> {% endfor %}</p>
<table><tr><th>layer</th><th>span (us)</th><th>GPU busy</th><th>CPU busy</th><th>GPU/CPU overlap (us)</th><th>copies (us)</th><th></th></tr>
{% set widest = layers(p)|map(attribute="span_us")|max %}
{% for t in layers(p) %}<tr><td>{{ "L%d"|format(t.layer) if t.layer is not none else "outside layers" }}</td>
<td class="num">{{ "%.1f"|format(t.span_us) }}</td><td class="num">{{ "%.0f"|format(100 * t.gpu_busy) }}%</td>
<td class="num">{{ "%.0f"|format(100 * t.cpu_busy) }}%</td><td class="num">{{ "%.1f"|format(t.overlap_us) }}</td>
<td class="num">{{ "%.1f"|format(t.copy_us) }}</td>
<td><span class="bar bgpu" style="width: {{ 300 * t.gpu_us / widest }}px"></span><br>
<span class="bar bcpu" style="width: {{ 300 * t.cpu_us / widest }}px"></span></td></tr>
{% endfor %}</table>
{% endfor %}

<h2>Expert Deferral (decode plan)</h2>
{% set defers = pf.decode.ir.nodes|selectattr("op.value", "equalto", "defer")|list %}
{% if defers %}<table><tr><th>deferred edge</th><th>from layer</th><th>to layer</th><th>why</th></tr>
{% for n in defers %}<tr><td>{{ n.name }}</td><td class="num">{{ n.attrs.src }}</td><td class="num">{{ n.attrs.dst }}</td>
<td>{{ n.place.cause }}</td></tr>
{% endfor %}</table>{% else %}<p>No deferral (option <code>defer</code> unset or 0, or <code>auto</code> predicted the plan without it fastest; prefill plans never defer).</p>{% endif %}

{% for p in [pf.decode, pf.prefill[-1]] %}
<h2>Placement, {{ p.phase }} plan{% if p.phase == "prefill" %} (largest bucket, {{ p.step_tokens }} tokens){% endif %}</h2>
<table><tr><th>node</th><th>op</th><th>device</th><th>weights</th><th>step time</th><th>cause</th></tr>
{% for n in p.ir.nodes %}<tr><td>{{ n.name }}</td><td>{{ n.op.value }}</td>
<td class="{{ n.place.device.value }}">{{ n.place.device.value }}{% if n.place.stream %} ({{ n.place.stream }} lane){% endif %}</td>
<td class="num">{{ si(n.weight_elems()) }}</td><td class="num">{{ si(n.cost.on(n.place.device)) }}s</td>
<td>{{ n.place.cause }}</td></tr>
{% endfor %}</table>
{% endfor %}
</body></html>
"""


def render_report(pf: PlanFile) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        pf=pf, plans=pf.plans, layers=layer_times, util=step_utilisation, si=_si, decisions=prefill_decisions,
        gb=lambda b: f"{b / 1e9:.2f} GB")


def write_report(pf: PlanFile, path) -> None:
    write_atomic(path, render_report(pf))
