"""The MLflow UI as the place a user looks (issue 38, part 2): experiments tagged with MLflow's own
experiment kind (model training, not GenAI), and a grid's parent run holding its report PDF, the
claims as a table artifact and a verdict tag per claim, read back through the MLflow client."""
from __future__ import annotations

import pytest

from analysis.claims import CLAIM_TAG, CLAIMS_TABLE, TABLE_COLUMNS
from analysis.synthetic import Curve, write_ablation
from harness import tracking
from reports.build import build

from helpers import ETAS, SEEDS, fast_dir, store_uri, write_registry


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root, cleanup = fast_dir(tmp_path_factory, "mlflow-ui")
    uri = store_uri(root)
    parent = write_ablation(uri, "kl_eta", "15", {
        ETAS[0]: Curve(kl_slope=0.006), ETAS[1]: Curve(kl_slope=0.004), ETAS[2]: Curve(kl_slope=0.002),
    }, seeds=SEEDS, steps=20)
    registry = write_registry(root / "ablations")
    yield {"uri": uri, "parent": parent, "registry": registry, "root": root}
    cleanup()


def test_experiments_open_as_model_training(store):
    c = tracking.client(store["uri"])
    assert c.get_experiment_by_name("kl_eta").tags["mlflow.experimentKind"] == "custom_model_development"
    # an experiment of an older store, made without the tag, gets it when next used; a kind set by hand stays
    old = c.create_experiment("older")
    mine = c.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    tracking.ensure_experiment(store["uri"], "older")
    tracking.ensure_experiment(store["uri"], "mine")
    assert c.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert c.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"
    # the address that opens the UI in its model-training view (MLflow 3.17 follows its own switch)
    exp = c.get_experiment_by_name("kl_eta").experiment_id
    assert tracking.ui_url(store["uri"], "kl_eta") == f"http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning"


def test_parent_run_holds_the_report_and_the_claims(store, monkeypatch):
    uri, parent = store["uri"], store["parent"]
    for _ in range(2):  # a second build replaces the claims, it does not add to them
        res = build(["kl_eta"], uri, store["root"] / "out", ablations_dir=store["registry"])
    assert not res.errors
    c = tracking.client(uri)
    names = {a.path for a in c.list_artifacts(parent)}
    assert {"report.pdf", CLAIMS_TABLE, "figures"} <= names
    run = c.get_run(parent)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # load_table searches the runs of the default store
    table = c.load_table(run.info.experiment_id, CLAIMS_TABLE, run_ids=[parent], extra_columns=["run_id"])
    n = len(table)  # every claim of kl_eta in helpers.REGISTRY, once
    assert list(table.columns) == TABLE_COLUMNS + ["run_id"] and n == 7 and table["claim"].is_unique
    first = table.iloc[0]
    assert first["claim"] == "A larger KL penalty η keeps KL lower." and first["verdict"] == "reproduced"
    assert first["test"] and first["n"] and first["interval"].startswith("[")
    assert run.data.tags[f"{CLAIM_TAG}01"] == "reproduced"
    assert run.data.tags[f"{CLAIM_TAG}01.text"] == first["claim"]
    assert sorted(k for k in run.data.tags if k.startswith(CLAIM_TAG) and not k.endswith(".text")) == [
        f"{CLAIM_TAG}{k:02d}" for k in range(1, n + 1)]
    assert [run.data.tags[f"{CLAIM_TAG}{k:02d}"] for k in range(1, n + 1)] == list(table["verdict"])
    counts = {v: run.data.metrics[f"claims/{v}"] for v in ("reproduced", "not_reproduced", "inconclusive")}
    assert sum(counts.values()) == n and counts == {v.replace(" ", "_"): float((table["verdict"] == v).sum())
                                                     for v in ("reproduced", "not reproduced", "inconclusive")}
    # the UI's search box: parent runs filtered by a claim's verdict
    found = c.search_runs([run.info.experiment_id], f"tags.`{CLAIM_TAG}01` = 'reproduced'")
    assert [r.info.run_id for r in found] == [parent]
