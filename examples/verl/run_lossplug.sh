#!/usr/bin/env bash
# Launch verl's PPO trainer with lossplug selected purely by config.
#
#   bash examples/verl/run_lossplug.sh                               # DAPO-style recipe (dapo_lossplug.overrides)
#   bash examples/verl/run_lossplug.sh examples/verl/ppo_lossplug.overrides trainer.total_epochs=2
#
# Needs verl 0.9.1 with its GPU extras (vLLM, FSDP, transfer_queue) and lossplug installed in the same environment
# (`pip install -e <lossplug checkout>`, or `pip install 'lossplug[verl]'`): `import verl` then registers
# loss_mode=lossplug and adv_estimator=lossplug in the driver, the trainer and every Ray worker through lossplug's
# `verl.plugins` entry point. Nothing is imported by hand. Extra arguments are appended as further Hydra overrides.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
overrides_file="${here}/dapo_lossplug.overrides"
if [[ $# -gt 0 && "$1" == *.overrides ]]; then
    overrides_file="$1"
    shift
fi

# fail early and clearly if lossplug is not reachable through `import verl`
python3 -c "import verl; from lossplug.adapters.verl import check_registration; check_registration()"

# one override per line, verbatim (no shell expansion: ${oc.env:HOME} is resolved by OmegaConf)
mapfile -t overrides < <(grep -vE '^[[:space:]]*(#|$)' "${overrides_file}")
exec python3 -m verl.trainer.main_ppo "${overrides[@]}" "$@"
