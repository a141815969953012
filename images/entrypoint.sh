#!/bin/bash
# The XPU images' entrypoint: the oneAPI / oneCCL environment a non-interactive start does not get (the bases
# source it from /root/.bashrc, which `docker run` never reads), then the server.
#
# Each base lays it out differently, so each file is sourced only where it exists:
# - intel/llm-scaler-vllm 0.21 (route a): its runtime stage has no compiler and no setvars.sh, only oneCCL's
#   /opt/intel/oneapi/ccl/2021.15/env/vars.sh with ccl/latest pointing at it;
# - vLLM's own XPU images (route b): setvars.sh on bases built on deep-learning-essentials, none on later ones.
# B70_ENTRYPOINT_ROOT prefixes the paths for tests against a base's layout; it is empty in the images.
root="${B70_ENTRYPOINT_ROOT:-}"

for script in "${root}/opt/intel/oneapi/setvars.sh" "${root}/opt/intel/oneapi/ccl/latest/env/vars.sh"; do
    if [ -f "${script}" ]; then
        # shellcheck disable=SC1090
        source "${script}" --force >/dev/null \
            || { echo "b70-entrypoint: ${script} failed: the image's oneAPI environment is broken" >&2; exit 1; }
    fi
done

if [ "$#" -eq 0 ]; then
    echo "b70-entrypoint: no command given: pass the server command (the image's CMD)" >&2
    exit 2
fi
exec "$@"
