"""`ktflow serve`: an OpenAI-compatible HTTP server over a compiled model (and the Anthropic
Messages API).

One job per module: `schemas` (request and response bodies, validation errors naming the field),
`tokenizer` (tokenizer.json, chat templates), `stops` (ids to text with stop strings held back),
`runner` (the Runner interface the scheduler runs the model through, and its per-sequence
implementation), `engine` (the continuous-batching scheduler thread), `metrics` (Prometheus),
`app` (the Starlette routes), `anthropic` (the Messages API's request and answer), `grammar`
(structured output: response_format's grammar masking each step's logits), `server`
(building it all and running uvicorn), `tool_parsers` (tool calls out of a model's text, a format
a file), `reasoning` (thinking apart from the answer), `ranks` (rank 0
serving, the other GPU ranks following its steps) and `chat` (chat for applications in Python).
"""
