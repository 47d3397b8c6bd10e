"""projected-grpo: GRPO fine-tuning that tests and fights reward hacking."""

__version__ = "0.1.0"
