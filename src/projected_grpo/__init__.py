"""projected-grpo: GRPO fine-tuning that tests and fights reward hacking.

The Python API (projected_grpo/api.py): `preset`, `train`, `experiment`, `report`, `Config`, `PRESETS`.
They are imported on first use, so `import projected_grpo` (and the CLI's start) stays light.
"""

__version__ = "0.1.0"
__all__ = ["PRESETS", "Config", "experiment", "preset", "report", "train"]


def __getattr__(name: str):
    if name in __all__:
        from projected_grpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'projected_grpo' has no attribute {name!r}")
