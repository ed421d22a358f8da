# The set-up of the scripts that regenerate shipped assets, sourced with their run folder's default:
#   source "$(dirname "$0")/_common.sh" runs/NAME
# From the repository root, with the environment set up (run.sh setup): PY its Python, RUN the run
# folder (JLENS_SHIP_DIR, else the argument; made), EVAL_TEXTS the held-out texts evaluated (default 40).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash run.sh setup
PY=.venv/bin/python
RUN="${JLENS_SHIP_DIR:-$1}"
EVAL_TEXTS="${EVAL_TEXTS:-40}"
mkdir -p "$RUN"
