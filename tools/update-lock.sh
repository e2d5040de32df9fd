#!/usr/bin/env bash
# Re-resolve every dependency and write constraints.txt: the exact versions the README's commands and CI install.
#
#   tools/update-lock.sh
#
# Run it on purpose (a new dependency, a security fix), never as part of an install: the lock is what makes a
# result reproducible. The synthetic ward is drawn with OpenCV and NumPy, so a new version of either can change
# the data and every number; tests/test_data.py pins the ward's pixels and fails when that happens. Then re-run
# benchmarks/reproduce.py and update the results with the lock, in one commit.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --upgrade pip
# torch: the CPU build from this machine's disk (a bare `torch` would pull a multi-GB CUDA build); a GPU site
# installs its CUDA build first and then uses this file as constraints (torch stays at the same version).
"$tmp/venv/bin/pip" install -q torch==2.13.0
"$tmp/venv/bin/pip" install -q -e '.[train,edge,test]'
{
  echo "# The exact versions behind the README's commands and CI: pip install -c constraints.txt ..."
  echo "# Written by tools/update-lock.sh on $(date -u +%Y-%m-%d) (Python $("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())')); do not edit by hand."
  "$tmp/venv/bin/pip" freeze --exclude-editable | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/' | grep -v '^pip=='
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
