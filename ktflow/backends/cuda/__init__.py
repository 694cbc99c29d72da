"""The CUDA backend: captured decode graphs, the prefill runner, the graph-safe rules."""
