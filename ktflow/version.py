__version__ = "0.1.0"
#: bumped whenever the plan JSON layout changes
PLAN_FORMAT = 5  # 5: buffers live on the graph's nodes (the buffer pass), per token
