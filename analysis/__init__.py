"""Reading finished ablations back from the MLflow store: pandas frames, figures, claim verdicts.

Nothing here talks to the trainer or the ablation runner; everything is read from the store
(names in `harness/keys.py`) and the ablation registry YAML files (format in docs/CONTRACTS.md).

- `analysis.spec`    the registry YAML as analysis needs it (variant names and order, panels, grid)
- `analysis.store`   runs, step metrics, samples and eval artifacts of one ablation as pandas
- `analysis.summary` smoothing, mean/spread over seeds, final/peak statistics per run
- `analysis.figures` the paper-style figure of an ablation (`python -m analysis.figures --help`)
- `analysis.claims`  the paper's claims as rules with verdicts (`python -m analysis.claims --help`)
- `analysis.synthetic` paper-shaped fake runs for tests and previews (`python -m analysis.synthetic --help`)
"""
