"""Config and checkpoint in: the HF config's parse, the model graph spec, weights, FP8/int quantization."""
