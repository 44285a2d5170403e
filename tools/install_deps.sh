#!/usr/bin/env bash
# Installs what megatron.cpp needs on Debian 12 / Ubuntu 24.04 (as root, apt reachable); skips
# packages already present. The CUDA toolkit is optional and auto-detected in /usr/local/cuda.
set -euo pipefail
pkgs=(build-essential cmake libopenblas-dev libcli11-dev nlohmann-json3-dev libfmt-dev libgtest-dev
      libopenmpi-dev openmpi-bin pkg-config libsentencepiece-dev libcpp-httplib-dev)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
