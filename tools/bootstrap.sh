#!/usr/bin/env bash
# Installs what ShardTrain needs on a fresh Debian 12 machine, idempotently:
#   - Debian packages: Bazel 4 (bazel-bootstrap) and its rule sets, Abseil, glog,
#     gflags, GoogleTest, nlohmann-json, Gloo's headers, zlib, the Fashion-MNIST data set;
#     clang-14 and its libFuzzer/sanitizer runtimes (tools/fuzz/run_checkpoint_fuzzer.sh);
#     iproute2, Open MPI, SLURM and MUNGE for the multi-host tests (tests/cluster);
#     nginx (CI's remote cache);
#   - the pinned PyPI torch (LibTorch's C++ headers and libraries plus Python
#     PyTorch for reference runs) into the project-local prefix .deps/venv.
# pip's download cache stays in the user's cache directory, outside the clone.
# Prints what it does; prints nothing but a one-line summary when all is present.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="2.11.0"
PREFIX="$ROOT/.deps/venv"
DEBIAN_PACKAGES=(
  bazel-bootstrap bazel-rules-java bazel-platforms
  libabsl-dev libgoogle-glog-dev libgflags-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libgloo-dev zlib1g-dev libssl-dev libisal-dev dataset-fashion-mnist fortunes
  libsentencepiece-dev libpcre2-dev libicu-dev
  python3 python3-venv binutils g++ clang-14 libclang-rt-14-dev
  iproute2 util-linux openmpi-bin slurmctld slurmd slurm-client munge
)
# The remote cache .ci/run serves on loopback (tools/ci/remote_cache.sh): nginx
# with WebDAV PUT.
DEBIAN_PACKAGES+=(nginx-light)

say() { echo "[bootstrap] $*" >&2; }

missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The machine's own python3 (e.g. pyenv) may stand in for Debian's.
if command -v python3 >/dev/null && python3 -c 'import venv' 2>/dev/null; then
  tmp=(); for p in "${missing[@]}"; do [[ "$p" == python3* ]] || tmp+=("$p"); done; missing=("${tmp[@]+"${tmp[@]}"}")
fi
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  say "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

STAMP="$PREFIX/.shardtrain-torch-$TORCH_VERSION"
if [[ ! -f "$STAMP" ]]; then
  say "installing torch==$TORCH_VERSION and numpy into $PREFIX (several GB; pip's cache is reused)"
  python3 -m venv "$PREFIX"
  "$PREFIX/bin/pip" install --disable-pip-version-check -q "torch==$TORCH_VERSION" numpy >&2
  "$PREFIX/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__"
  touch "$STAMP"
fi

# Python packages the tests compare with (reference readers and oracles),
# pinned beside torch; the stamp names the pins, so changing one reinstalls.
PY_ORACLE_PINS=(
  tensorboard==2.21.0  # tests/trainer/tensorboard_reader.py: its EventFileLoader reads our event files
  lightning==2.6.6     # tests/trainer/lightning_interop_check.py: the full checkpoint's layout (trainer/checkpoint_io/checkpoint.h kLightningVersion)
  safetensors==0.8.0   # tests/trainer/safetensors_check.py: Hugging Face's tensor files (trainer/checkpoint_io/safetensors.h)
  transformers==5.25.0 # tests/examples/llama_hf_check.py: the Llama reference (examples/llama)
  sentencepiece==0.2.1 # tests/examples/llama_train_check.py: the tokenizer reference (examples/llama/tokenizer.h)
  tokenizers==0.23.3   # tests/examples/llama_train_check.py: the byte-level BPE reference (examples/llama/bpe_tokenizer.cc)
)
PINS_STAMP="$PREFIX/.shardtrain-pins-$(printf '%s\n' "${PY_ORACLE_PINS[@]}" | md5sum | cut -c1-12)"
if [[ ! -f "$PINS_STAMP" ]]; then
  say "installing the tests' Python references into $PREFIX: ${PY_ORACLE_PINS[*]}"
  "$PREFIX/bin/pip" install --disable-pip-version-check -q "${PY_ORACLE_PINS[@]}" >&2
  rm -f "$PREFIX"/.shardtrain-pins-*
  touch "$PINS_STAMP"
fi
