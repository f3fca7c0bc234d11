"""harness: an ablation and experiment-tracking harness for RLHF with PPO."""
import sys
from pathlib import Path


def prog(module: str) -> str:
    """The command as typed: the installed script's name (`harness-train`), else `python -m MODULE`."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("harness-") else f"python -m {module}"
