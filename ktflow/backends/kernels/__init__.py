"""GPU and shared tensor kernels the backends call (Triton and torch): no planning, no state."""
