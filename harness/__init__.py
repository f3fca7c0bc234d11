"""harness: an ablation and experiment-tracking harness for RLHF with PPO."""
import os
import sys
from pathlib import Path

# The harness runs offline. MLflow's usage telemetry (on by default since MLflow 3.2) fetches its config over the
# network from a thread at each process's first MLflow import, and on failure that thread clears an environment
# variable while a request to an MLflow server may be reading the environment: a worker's log_batch failed with
# KeyError '_MLFLOW_TELEMETRY_SESSION_ID' (tests/test_redaction.py). Off unless the user sets the variable.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def prog(module: str) -> str:
    """The command as typed: the installed script's name (`harness-train`), else `python -m MODULE`."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("harness-") else f"python -m {module}"
