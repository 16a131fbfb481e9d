# Makes bench/peers.py runnable on the GPU machine, which reaches no package index: installs the
# wheels carried in .whl/ (name .whl in the device tool's carry) into /tmp/site ($PEERS_SITE) and
# puts that on PYTHONPATH. Source it from the repository root (it exports PYTHONPATH and, where
# needed, PATH):
#
#   . bench/peers_setup.sh [superoffload wheel]
#
# The superoffload wheel, if given, goes into the same directory; without one the package must
# already be importable. The carried wheels (for CPython 3.12, x86-64):
#   torchao 0.18.0; deepspeed 0.19.8 (a py3-none-any wheel built from its sdist with
#   DS_ACCELERATOR=cuda DS_BUILD_OPS=0: no op compiled); and what DeepSpeed needs that the image
#   lacks: hjson, pydantic 2.11 with pydantic-core, annotated-types and typing-inspection.
# From the image: torch, transformers, accelerate, ninja, msgpack, py-cpuinfo, psutil, einops,
# numpy, packaging, tqdm, typing-extensions, nvidia-ml-py, and g++.
# DeepSpeed builds its CPU Adam op (C++ only, -march=native) with ninja and g++ the first time a
# DeepSpeed worker creates its optimizer (about a minute, in that worker's set-up, not in its
# timed steps), into ~/.cache/torch_extensions.

peers_setup() {
    local site="${PEERS_SITE:-/tmp/site}"
    ls .whl/*.whl > /dev/null 2>&1 ||
        { echo "peers_setup: no .whl/*.whl here (run from the repository root, carry .whl)" >&2; return 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/*.whl ${1:+"$1"} || { echo "peers_setup: installing the wheels failed" >&2; return 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # torch's extension builder runs `ninja`; the image's ninja package has the binary.
    if ! command -v ninja > /dev/null; then
        PATH="$(python3 -c 'import ninja; print(ninja.BIN_DIR)')${PATH:+:$PATH}" || return 1
        export PATH
    fi
    python3 -c 'import torch, transformers, superoffload' ||
        { echo "peers_setup: bench/peers.py needs torch, transformers and superoffload (see above)" >&2; return 1; }
    echo "peers_setup: wheels in $site, on PYTHONPATH"
}

peers_setup "$@"
