#!/usr/bin/env bash
# Check tpuft's trainer on a real TPU slice of a GKE cluster with tpuft installed: saves, a SIGTERM
# stop (suspend), a resume and the export, then the status and tpuft-metrics.json. NOT YET RUN ON A
# SLICE BY THE PROJECT (what is proven where: docs/trainer.md); please report its output.
#   scripts/verify-on-slice.sh --type v5p --topology 2x2x2 --output gs://BUCKET/tpuft-verify \
#       --service-account tpuft-trainer          # add --dry-run to see the manifest and commands
# Needs kubectl (pointing at the cluster) and gcloud (for gs://); runs in the project's venv.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$here/scripts/venv.sh" | tail -1)
exec "$venv/bin/python" -m tpuft_dev.verify_slice "$@"
