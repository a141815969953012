"""How long one vLLM process of the CPU serving image takes to import its server, with the image's bytecode and
without it (as every start was before images/cpu/Dockerfile compiled it: uv leaves none, and each start is a new
container, so nothing a start compiled was kept).

    .venv/bin/python benchmarks/image_import.py [--image ID] [--runs 3]

Each run is a fresh container (`docker run --rm`, as the unit starts one), timing `import
vllm.entrypoints.openai.api_server` inside it: "as built" imports with the image's .pyc files; "no bytecode" deletes
them first and imports with -B (nothing written), so each run compiles again, as a start without them did. A
vLLM server at TP=2 is four such processes (API server, engine core, two workers), each importing vLLM.
Prints both medians and their ratio. The image defaults to the newest localhost/b70/vllm-cpu on the default engine
(scripts/testhosts engine; `b70ctl image build --recipe cpu-tiny` makes it).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess

TIMED_IMPORT = ("import time; started = time.perf_counter(); import vllm.entrypoints.openai.api_server; "
                "print(time.perf_counter() - started)")


def newest_image() -> str:
    listed = subprocess.run(["docker", "image", "ls", "--no-trunc", "--format", "{{.ID}}", "localhost/b70/vllm-cpu"],
                            capture_output=True, text=True, check=True).stdout.split()
    if not listed:
        raise SystemExit("no localhost/b70/vllm-cpu image on this engine: run `b70ctl image build --recipe cpu-tiny`")
    return listed[0]


def timed(image: str, keep_bytecode: bool) -> float:
    script = (f"/opt/vllm/bin/python -c '{TIMED_IMPORT}'" if keep_bytecode else
              "find /opt/vllm -name '*.pyc' -delete && "
              f"/opt/vllm/bin/python -B -c '{TIMED_IMPORT}'")
    result = subprocess.run(["docker", "run", "--rm", "--network=none", "--entrypoint", "sh", image, "-c",
                             f"{script} 2>/dev/null"], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", help="image id (default: the newest localhost/b70/vllm-cpu)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    image = args.image or newest_image()
    figures: dict[str, list[float]] = {"as built": [], "no bytecode": []}
    for run in range(args.runs):  # interleaved, so load that comes and goes falls on both
        for label, keep in (("as built", True), ("no bytecode", False)):
            figures[label].append(timed(image, keep))
            print(f"run {run + 1}/{args.runs} {label}: {figures[label][-1]:.1f} s", flush=True)
    built, bare = statistics.median(figures["as built"]), statistics.median(figures["no bytecode"])
    print(f"image {image[:19]}: import of the API server, median of {args.runs}: as built {built:.1f} s, "
          f"no bytecode {bare:.1f} s ({bare / built:.2f}x)")


if __name__ == "__main__":
    main()
