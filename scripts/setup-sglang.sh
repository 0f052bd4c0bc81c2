#!/usr/bin/env bash
# Install the SGLang engine itself (not only its gateway) into its own venv, for the tests in
# tests/sglang: $KVCANARY_SGLANG_VENV, or $XDG_CACHE_HOME/kvcanary/venv-sglang (~/.cache by default),
# outside the clone, so fresh clones on one machine share one 2.8 GB install. scripts/test.sh runs it
# beside the other engines' setups (docs/sglang-engine.md says what it shows and costs).
#
#   bash scripts/setup-sglang.sh          # idempotent: a second run only checks the stamp
#   FORCE=1 bash scripts/setup-sglang.sh  # rebuild from scratch
#
# Why so many steps: SGLang publishes no CPU build. Its wheel asks for CUDA torch 2.14.1 and CUDA
# kernel packages, so it goes in with --no-deps, then only the dependencies a CPU server imports, under
# a constraint pinning torch to the CPU wheel on local disk (otherwise pip pulls a CUDA torch).
# Two import-only stand-ins fill the rest (any use of one of their names raises, naming it):
# - sgl_kernel: every published sgl-kernel/sglang-kernel wheel links CUDA and there is no sdist, yet
#   SGLang's CPU path imports kernels from it at load. The ones it would call through torch.ops run
#   only when torch.ops.sgl_kernel has them (its Intel AMX backend), which the stand-in never
#   registers, so the native torch paths run; the ones it imports by name serve speculative decoding
#   only (its KV moves included), which this server never runs.
# - torchvision: the reachable wheel is a CUDA build whose import fails beside the CPU torch
#   ("operator torchvision::nms does not exist"), and SGLang imports it at load for its multimodal
#   models, as transformers does once it finds the stand-in; a text-only model needs none of it.
# And one mend: scripts/sglang_cpu_canary.py lets SGLang's own KV canary (--kv-canary) run on a CPU,
# where three pieces of its plumbing assume an accelerator (that file says which, and why the checks
# themselves stay SGLang's). A .pth line imports it in every process of the venv.
set -euo pipefail

TORCH_VERSION="2.13.0"
SGLANG_VERSION="0.5.23"
# SGLang's own pins where it has them; its CUDA-only packages (flashinfer, sglang-kernel, flash-attn,
# cuda-python, nvidia-*, deep-ep/gemm, tilelang, torchaudio, torchcodec, torchvision, ...) left out.
# The list is what a CPU server imports on its way to serving a Llama (found by starting one).
DEPENDENCIES=(
    "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "openai==2.8.0"
    "openai-harmony==0.0.4" "compressed-tensors==0.18.0" "xgrammar==0.2.7" "blobfile==3.0.0"
    "soundfile==0.13.1" aiohttp anthropic dill distro einops fastapi gguf interegular IPython jsonschema
    llguidance msgspec numpy orjson packaging partial_json_parser pillow prometheus-client psutil
    pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests safetensors
    scipy setproctitle tiktoken tqdm triton "uvicorn>=0.51" uvloop watchfiles xxhash zstandard
)

VENV="${KVCANARY_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcanary/venv-sglang}"
STAMP="$VENV/.kvcanary-setup"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
# The stamp records what pip installed; the stand-ins and the canary's mend are this repository's
# files, written on every run (a fraction of a second), so a change to them needs no rebuild.
WANT="torch==$TORCH_VERSION sglang==$SGLANG_VERSION deps=${DEPENDENCIES[*]} python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
CPU_CANARY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/sglang_cpu_canary.py"

start=$(date +%s)
log() { echo "setup-sglang: [$(( $(date +%s) - start ))s] $*"; }

# Write the two stand-ins into site-packages ($1); the header says why each is needed. Each is a
# package any name and any submodule of which is a stand-in, so no list of names has to follow
# SGLang's imports from release to release.
write_stand_ins() {
    "$VENV/bin/python" - "$1" <<'PY'
import sys
from pathlib import Path

site = Path(sys.argv[1])
NOTE = "kvcanary's import-only stand-in (scripts/setup-sglang.sh says why)"

# Any use of a stand-in name raises, naming it, so a path that needs the real package fails plainly.
STAND_IN = f'''"""{NOTE}"""

import importlib.abc
import importlib.util
import sys
import types


class StandIn:
    """A name from a package that is not installed: attributes are stand-ins too; calling one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> "StandIn":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return StandIn(f"{{self._name}}.{{attribute}}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{{self._name}} was called, but it is only a stand-in: {NOTE}")

    def __repr__(self) -> str:
        return f"<stand-in {{self._name}}>"


class StandInModule(types.ModuleType):
    """A module every name of which is a stand-in."""

    def __getattr__(self, attribute: str) -> StandIn:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return StandIn(f"{{self.__name__}}.{{attribute}}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import any submodule of a stand-in package (torchvision.io, torchvision.transforms.v2, ...)."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self._prefix):
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec) -> StandInModule:
        return StandInModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


def stand_in_package(package: str) -> None:
    sys.meta_path.append(_Submodules(package))
'''
PACKAGE = (
    f'"""{NOTE}"""\nimport sys\n\nfrom kvcanary_stand_in import StandInModule, stand_in_package\n\n'
    "stand_in_package(__name__)\n"
    "sys.modules[__name__].__class__ = StandInModule\n"
)
files = {
    "kvcanary_stand_in.py": STAND_IN,
    # Imported at load by srt/mem_cache/allocation.py, kernels/ops/kvcache/cache_move.py and
    # kernels/ops/speculative/*.
    "sgl_kernel/__init__.py": PACKAGE,
    # Imported at load by srt/configs/ and srt/multimodal/, and by transformers' image utilities.
    "torchvision/__init__.py": PACKAGE + '__version__ = "0.0.0+kvcanary.stand.in"\n',
}
for relative, text in files.items():
    path = site / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
PY
    # The canary's CPU mend, imported by every interpreter of the venv (the scheduler is a spawned
    # process, so a mend made in the launcher alone would not reach it).
    cp "$CPU_CANARY" "$1/kvcanary_sglang_cpu_canary.py"
    echo "import kvcanary_sglang_cpu_canary; kvcanary_sglang_cpu_canary.install()" > "$1/kvcanary-sglang-cpu-canary.pth"
}
site_packages() { "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

set_up() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; }
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    write_stand_ins "$(site_packages)"
    log "already set up in $VENV (sglang==$SGLANG_VERSION)"
    exit 0
fi

# Two clones set up at once (parallel CI jobs) must not install into one venv together; the second
# finds the first one's stamp once it holds the lock.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ "${FORCE:-0}" != "1" ]] && set_up; then
    write_stand_ins "$(site_packages)"
    log "set up meanwhile in $VENV (sglang==$SGLANG_VERSION)"
    exit 0
fi
log "creating $VENV with $PYTHON"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip.conf names local indexes that lack most projects; pip warns once per project.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# pip then lists every dependency of sglang's left out on purpose (above) as a conflict: expected.
QUIET_CONFLICTS=(-e "^sglang $SGLANG_VERSION requires" -e "dependency resolver does not currently take")
CONSTRAINT="$VENV/kvcanary-constraint.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINT"

log "installing torch==$TORCH_VERSION (the CPU wheel on local disk)"
quiet_pip install --quiet "torch==$TORCH_VERSION"

log "installing sglang==$SGLANG_VERSION without its dependencies"
quiet_pip install --quiet --no-deps "sglang==$SGLANG_VERSION"

log "installing the dependencies a CPU server imports (torch held at $TORCH_VERSION)"
quiet_pip install --quiet -c "$CONSTRAINT" "${DEPENDENCIES[@]}" 2>&1 | { grep -v "${QUIET_CONFLICTS[@]}" || true; }

log "writing the stand-ins for sgl_kernel and torchvision, and the canary's CPU mend"
write_stand_ins "$(site_packages)"

log "checking the modules a CPU server loads, and that the stand-ins keep the AMX kernels off"
(cd "$VENV" && SGLANG_USE_CPU_ENGINE=1 PYTHONWARNINGS=ignore "$VENV/bin/python" - <<'EOF'
import importlib
import importlib.metadata as md

import torch

# What `python -m sglang.launch_server` imports by the time it serves (a missing one fails here,
# not in the middle of a test's server start).
for module in (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
    "sglang.srt.layers.attention.torch_native_backend",
):  # fmt: skip
    importlib.import_module(module)
from sglang.srt.utils.common import cpu_has_amx_support

assert torch.__version__.endswith("+cpu"), f"expected the CPU torch, got {torch.__version__}"
# The stand-in registers no torch.ops.sgl_kernel, so SGLang keeps to its native CPU paths.
assert not cpu_has_amx_support(), "SGLang would call sgl_kernel's AMX kernels, which the stand-in lacks"
# The canary's CPU mend is in place: the stream SGLang's canary asks for on a CPU can be made.
from sglang.srt.utils import create_device_stream

create_device_stream(torch.device("cpu"))
for name in ("sglang", "torch", "transformers", "tokenizers", "safetensors"):
    print(f"  {name}=={md.version(name)}")
EOF
)

echo "$WANT" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
