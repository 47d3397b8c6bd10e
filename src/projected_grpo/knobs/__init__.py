"""The trainable parameterisation (SVD / LoRA knobs) and its geometry: per-source split, projection."""
