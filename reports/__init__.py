"""PDF reports assembled from the MLflow store and the ablation registry (`python -m reports.build --help`)."""
