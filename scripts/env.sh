# Sourced by the README's commands: creates .venv on first use and installs the project into it.
# CPU machines get PyTorch 2.13 (CPU build); the native extension builds at first import.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -x "$_root/.venv/bin/python" ]; then
  python3 -m venv "$_root/.venv"
fi
# shellcheck disable=SC1091
source "$_root/.venv/bin/activate"
_stamp="$_root/.venv/.l3pool-installed"
_torch=2.13.0+cpu
if [ ! -f "$_stamp" ] || [ "$_root/pyproject.toml" -nt "$_stamp" ]; then
  echo "[env] installing into $_root/.venv (first run only)"
  python -m pip install -q --upgrade pip setuptools
  # the CPU build, by name (+cpu): a plain torch==2.13.0 from PyPI is the CUDA build (several GB).
  # PyPI does not carry +cpu builds: a wheel already on this machine (pip's find-links, e.g.
  # PIP_FIND_LINKS) is used when there is one, else PyTorch's CPU index (L3POOL_TORCH_INDEX: a mirror).
  if ! python -m pip install -q "torch==$_torch" 2>/dev/null; then
    python -m pip install -q "torch==$_torch" --index-url "${L3POOL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
      --extra-index-url https://pypi.org/simple
  fi
  python -m pip install -q --no-build-isolation -e "$_root[dev,sglang,real]"
  # sglang pins torch==2.14.1 (CUDA): only its package (its light import-time deps come from [sglang];
  # pip would list every other requirement of it as missing, hence --no-warn-conflicts)
  python -m pip install -q --no-deps --no-warn-conflicts sglang==0.5.23
  touch "$_stamp"
fi
