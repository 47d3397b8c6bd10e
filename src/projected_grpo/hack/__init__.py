"""V_hack: from contrastive (hack, clean) pairs to per-module hack directions."""
