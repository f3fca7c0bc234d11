"""Finished ablations read back from the MLflow store and the registry alone: store, figures,
claims (on the tests of stats), synthetic stores for tests and previews, Optuna sweeps."""
