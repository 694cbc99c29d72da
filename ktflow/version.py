__version__ = "0.1.0"
#: bumped whenever the plan JSON layout changes
PLAN_FORMAT = 10  # 10: a task the host computes before the step is marked on its submit (on_host); 9: CPU and streamed expert parts and fetches name their layer's host experts (host); 8: the VRAM plan (PlanFile.vram), gpu_bytes without the reserve, streamed layers fetched in groups (running); 7: a prefill step streaming a cached layer whole (cache_slots); 6: a cached expert layer's refill interval (refill_every); 5: buffers live on the graph's nodes (the buffer pass), per token
