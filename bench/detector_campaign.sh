#!/usr/bin/env bash
# A held-out campaign for the early warning (issue 35; bench/RESULTS.md, sessions 22-28): on one world
# seed, every run of the figure files below at a budget long enough to know whether its gold fell (four
# times each file's steps: Fig. 6 at 480, the 200-step files at 800), each with the world's audit RMs and
# collapse.stop_on_collapse, into a store of its own; then the runs file the detector scores in seconds:
#   python -m analysis.detector evaluate --runs OUT/runs.npz --params harness/detector_params.json
# Campaigns 3-11 ran this plan (46 runs on 2 cores with 2 workers, the world build included: about 40 min at
# budgets 400/240 (campaigns 3-6), 66 min at 800/240 (7), 53-71 min at 800/480 (8-11: worlds where more runs fell)).
#
# usage: bench/detector_campaign.sh WORLD_SEED OUT_DIR [WORKERS] [STEPS] [FIG6_STEPS]
#   WORLD_SEED  a world seed no detector was fit on (built once, cached under .harness/worlds/)
#   OUT_DIR     a new folder: OUT/mlflow.db, OUT/runs/, OUT/registry/, OUT/runs.npz
#   STEPS       the budget of the 200-step files (default 800; 400, twice their steps, missed critic-free falls: RESULTS.md s. 26)
#   FIG6_STEPS  Fig. 6's budget (default 480; 240, twice its steps, missed two of its falls: RESULTS.md s. 27)
set -euo pipefail
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2
fi
seed=$1; out=$(realpath -m "$2"); workers=${3:-2}; steps=${4:-800}; fig6=${5:-480}
case $seed in ''|*[!0-9]*) echo "WORLD_SEED: got '$seed'; allowed: a non-negative integer" >&2; exit 2;; esac
case $steps in ''|*[!0-9]*) echo "STEPS: got '$steps'; allowed: a whole number of steps, e.g. 800" >&2; exit 2;; esac
case $fig6 in ''|*[!0-9]*) echo "FIG6_STEPS: got '$fig6'; allowed: a whole number of steps, e.g. 480" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
py=.venv/bin/python
store=sqlite:///$out/mlflow.db
# The estimators without a KL penalty are a figure file of their own (its runs keep the name
# estimators_nokl in the runs file, apart from the estimators' own runs): a copy of the registry holds it.
mkdir -p "$out/registry"
cp -r ablations/. "$out/registry/"
sed -e 's/^name: estimators$/name: estimators_nokl/' ablations/estimators.yaml > "$out/registry/estimators_nokl.yaml"
run() {  # FILE SEEDS STEPS [KEY=VALUE ...]
    local file=$1 seeds=$2 steps=$3; shift 3
    echo "== $file seeds $seeds at $steps steps on world $seed ($(date +%T))"
    $py -m harness.ablate "$file" --registry "$out/registry" --worlds "$seed" --seeds "$seeds" \
        --workers "$workers" --tracking-uri "$store" --runs-dir "$out/runs" --no-progress \
        --set ppo.steps="$steps" model.audit_reward_paths=world collapse.stop_on_collapse=true "$@"
}
run score_reparam 0,1 "$fig6"
run policy_constraints 0,1 "$steps"
run estimators_nokl 0 "$steps" ppo.kl_coef=0
run estimators 0,1 "$steps"
run cispo 0 "$steps"
$py -m analysis.detector export --tracking-uri "$store" --to "$out/runs.npz"
echo "== done ($(date +%T)): $out/runs.npz"
