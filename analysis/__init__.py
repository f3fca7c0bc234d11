"""Finished ablations read back from the MLflow store and the registry alone: runs and metrics as
pandas (store), the paper-style figures (figures), the claims' verdicts (claims, on the
tests of stats), synthetic stores for tests and previews (synthetic), Optuna sweeps (sweep_plots)."""
