#!/usr/bin/env bash
# Vendor the original Marlin kernel (IST-DASLab/marlin) for the `marlin` benchmark peer
# (tilefish.bench.peers.marlin): copies marlin/marlin_cuda.cpp, marlin/marlin_cuda_kernel.cu, LICENSE and
# the commit hash out of a Marlin git directory into .peers/marlin/ (ignored by git; carry it to the device),
# and marlin/__init__.py as marlin_layer.py (only tests/test_marlin_peer.py reads it: its Layer.pack is
# checked against tilefish's packer; nothing imports it into the package).
# Usage: scripts/vendor_marlin.sh GIT_DIR [REV] [DEST]
#   GIT_DIR: a Marlin clone's .git, or a bare mirror (e.g. /work/.mirror/IST-DASLab+marlin/repo)
#   REV:     default HEAD (tested: 2f6d7c10e124b3c5fa29ff8d77d568bd7af3274c)
#   DEST:    default .peers/marlin under the repository root
set -euo pipefail
git_dir=${1:?usage: $0 GIT_DIR [REV] [DEST]}
rev=${2:-HEAD}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${3:-$root/.peers/marlin}
mkdir -p "$dest"
for f in marlin/marlin_cuda.cpp marlin/marlin_cuda_kernel.cu LICENSE; do
  git --git-dir="$git_dir" show "$rev:$f" > "$dest/$(basename "$f")"
done
git --git-dir="$git_dir" show "$rev:marlin/__init__.py" > "$dest/marlin_layer.py"
git --git-dir="$git_dir" rev-parse "$rev" > "$dest/COMMIT"
echo "vendored Marlin $(cat "$dest/COMMIT") into $dest"
