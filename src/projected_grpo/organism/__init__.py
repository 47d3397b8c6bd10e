"""The embedded default model organism: tokenizer, tiny LM, warm-up, checks."""
