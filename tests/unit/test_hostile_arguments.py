"""Hostile input, third round: arguments and files that reached a saved traceback (exit 2, "failed unexpectedly")
or a misleading line, and recipes whose requests cannot fit their server. Each is a row as in
test_hostile_inputs.py: the exit code, the one `error:` line naming the problem and the fix, nothing written outside
the target and nothing half-written; none leaves a traceback in the cache."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from hostile import GOOD_URL, Case, Invocation, run_b70ctl, run_case, snapshot


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def _verify(*extra: str, endpoint: str = GOOD_URL, out_made: bool = False) -> Callable[[Path], Invocation]:
    """verify into work/out; `out_made`: the row gets as far as making --out (a refusal before leaves nothing)."""
    return lambda work: Invocation(["verify", "--endpoint", endpoint, "--recipe", "cpu-tiny", "--check", "smoke",
                                    "--out", str(work / "out"), "--timeout", "5", *extra],
                                   may_write=[work / "out"] if out_made else [])


def _recipe_text(work: Path, change: Callable[[str], str]) -> Path:
    from b70ctl.recipes import recipe_path

    recipe = work / "recipe.yaml"
    recipe.write_text(change(recipe_path("cpu-tiny").read_text()))
    return recipe


def _recipe_value(path: tuple[str | int, ...], value_yaml: str) -> Callable[[str], str]:
    """cpu-tiny with the YAML scalar `value_yaml` at `path`."""
    def change(text: str) -> str:
        import yaml

        data = yaml.safe_load(text)
        node = data
        for key in path[:-1]:
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        node[path[-1]] = "@VALUE@"
        return yaml.safe_dump(data, sort_keys=False).replace("'@VALUE@'", value_yaml)
    return change


def _show(change: Callable[[str], str], command: str = "show") -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        recipe = _recipe_text(work, change)
        if command == "show":
            return Invocation(["recipes", "show", str(recipe)])
        if command == "render":
            return Invocation(["serve", "render", "--recipe", str(recipe)])
        return Invocation(["verify", "--endpoint", GOOD_URL, "--recipe", str(recipe), "--check", "throughput",
                           "--out", str(work / "out"), "--timeout", "5"])
    return build


NESTED_YAML = "nested: " + "[" * 100_000 + "]" * 100_000 + "\n"
LONG_PATH = "a" * 100_000
LONG_HOST = "h" * 100_000


def _dangling_out(work: Path) -> Invocation:
    (work / "out").symlink_to(work / "nowhere" / "out")
    return _verify()(work)


def _file_out(work: Path) -> Invocation:
    (work / "out").write_text("a file of the user's\n")
    return _verify()(work)


def _manifest_of(make: Callable[[Path], Path]) -> Callable[[Path], Invocation]:
    return lambda work: Invocation(["model", "manifest", str(make(work))])


def _duplicate_reference(work: Path) -> Invocation:
    """A reference file as verify records it, with its recipe given twice: first another recipe's, then this one."""
    (work / "ref.json").write_text('{"schema_version": 1, "recipe": "pr620-fp8-tp2", "recipe": "cpu-tiny", '
                                   '"served_model": "tiny-qwen3", "max_tokens": 48, "prompts": [], "outputs": []}')
    return Invocation(["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny", "--check", "correctness",
                       "--reference", str(work / "ref.json"), "--out", str(work / "out"), "--timeout", "5"])


def _duplicate_facts(work: Path) -> Invocation:
    (work / "facts.json").write_text('{"hostname": "b70-a", "hostname": "b70-b"}')
    return Invocation(["host", "fit", "--recipe", "cpu-tiny", "--facts", str(work / "facts.json")])


CASES = [
    # YAML that breaks Python's parser: one line, as JSON's does (files.parse_json).
    Case("recipe-nested-yaml", _show(lambda text: text + NESTED_YAML), 2,
         r"recipe file \S*recipe\.yaml: YAML nested too deeply \(Python reads about \d+ levels\): write it flatter"),
    Case("recipe-5000-digit-integer", _show(_recipe_value(("serve", "max_model_len"), "9" * 5000)), 2,
         r"recipe file \S*recipe\.yaml: a YAML number of more than \d+ digits: write a shorter number"),
    Case("render-5000-digit-integer", _show(_recipe_value(("serve", "max_model_len"), "9" * 5000), "render"), 2,
         r"recipe file \S*recipe\.yaml: a YAML number of more than \d+ digits"),
    # URLs past what the HTTP client takes: the line shows the start of the URL, and its length.
    Case("endpoint-100kB-path", _verify(endpoint=f"http://127.0.0.1:9/{LONG_PATH}"), 2,
         r"--endpoint 'http://127\.0\.0\.1:9/a{80,100}… \(100019 characters\)': not a valid URL \(URL too long\): "
         r"give a URL like http://host:8000$"),
    Case("endpoint-100kB-host", _verify(endpoint=f"http://{LONG_HOST}:8000"), 2,
         r"--endpoint 'http://h+… \(100012 characters\)': not a valid URL"),
    Case("baseline-100kB-path", _verify("--baseline-endpoint", f"http://127.0.0.1:9/{LONG_PATH}"), 2,
         r"--baseline-endpoint 'http://127\.0\.0\.1:9/a+… \(100019 characters\)': not a valid URL"),
    # A socket's timeout is a time_t.
    Case("timeout-1e308", _verify("--timeout", "1e308"), 2, r"--timeout 1e\+308: give at most 86400 s \(a day\)"),
    Case("timeout-a-day", _verify("--timeout", "86400", out_made=True), 2, r"endpoint \S+ unreachable"),
    # Requests that cannot fit the server's context: refused before a prompt is built in memory.
    Case("prompt-tokens-above-context", _show(_recipe_value(("workloads", 4, "prompt_tokens"), "10000000000")), 2,
         r"recipe file \S*recipe\.yaml: \(top level\): workloads\.4 \(long_prompt\): prompt_tokens 10000000000 \+ "
         r"max_tokens 64 do not fit in serve\.max_model_len 2048: lower them, or raise max_model_len"),
    Case("prompt-tokens-above-context-verify",
         _show(_recipe_value(("workloads", 4, "prompt_tokens"), "10000000000"), "verify"), 2,
         r"workloads\.4 \(long_prompt\): prompt_tokens 10000000000 \+ max_tokens 64 do not fit"),
    Case("max-tokens-1e21", _show(_recipe_value(("workloads", 0, "max_tokens"), "1" + "0" * 21)), 2,
         r"workloads\.0 \(short\): max_tokens 1000000000000000000000 and a prompt do not fit in "
         r"serve\.max_model_len 2048"),
    Case("correctness-max-tokens-above-context", _show(_recipe_value(("correctness", "max_tokens"), "4096")), 2,
         r"correctness: max_tokens 4096 and a prompt do not fit in serve\.max_model_len 2048"),
    Case("max-model-len-1e21", _show(_recipe_value(("serve", "max_model_len"), "1" + "0" * 21)), 2,
         r"serve\.max_model_len: Input should be less than or equal to 1048576"),
    Case("prompt-tokens-exactly-fitting", _show(_recipe_value(("workloads", 4, "prompt_tokens"), "1984")), 0, ""),
    # A tolerance of .inf is always met and a bound of .nan never ordered: no recipe number is other than finite.
    *(Case(f"claim-{name}-{value.strip('.')}", _show(_recipe_value(("claims", 0, *path), value)), 2,
           rf"recipe file \S*recipe\.yaml: claims\.0\.{re.escape('.'.join(path))}: Input should be a finite number")
      for name, path in (("tolerance", ("tolerance", "relative")), ("value", ("value",)))
      for value in (".inf", ".nan", "-.inf")),
    Case("claim-tolerance-inf-verify", _show(_recipe_value(("claims", 0, "tolerance", "absolute"), ".inf"), "verify"),
         2, r"claims\.0\.tolerance\.absolute: Input should be a finite number"),
    Case("serve-gpu-memory-utilization-nan", _show(_recipe_value(("serve", "gpu_memory_utilization"), ".nan")), 2,
         r"serve\.gpu_memory_utilization: Input should be a finite number"),
    # A key given twice in a JSON file: Python keeps the last, other readers the first.
    Case("reference-duplicate-key", _duplicate_reference, 2,
         r"reference file \S*ref\.json: key 'recipe' is given twice in one object: keep one .*: re-record"),
    Case("host-facts-duplicate-key", _duplicate_facts, 2,
         r"host facts \S*facts\.json: key 'hostname' is given twice in one object"),
    # --out that is no directory: named for what it is, not "File exists".
    Case("out-dev-full", _verify("--out", "/dev/full"), 2,
         r"--out /dev/full: a character device, not a directory: give a directory for the reports$"),
    Case("out-dangling-link", _dangling_out, 2,
         r"--out \S*out: a link to \S*nowhere/out, which does not exist: give a directory$"),
    Case("out-a-file", _file_out, 2, r"--out \S*out: a file, not a directory: give a directory for the reports$"),
    # model manifest over a directory of links and unreadable files.
    Case("manifest-proc-self", lambda work: Invocation(["model", "manifest", "/proc/self"]), 2,
         r"/proc/self/\S+ is a symbolic link: a host receives files, give the directory of real files$"),
    Case("manifest-unreadable-file", lambda work: Invocation(["model", "manifest", "/proc/self/attr"]), 2,
         r"/proc/self/attr/\S+: cannot be read \(.+\): give a directory of model files$"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_arguments(case: Case, tmp_path: Path) -> None:
    outcome = run_case(case, tmp_path)
    assert "\x1b" not in outcome.stdout + outcome.stderr
    assert not list((tmp_path / "xdg-cache").rglob("tracebacks/*"))


def test_the_out_path_reaches_the_terminal_as_text(tmp_path):
    """An --out holding escape sequences (a directory name from an inventory) is shown without them."""
    out = tmp_path / "x\x1b]0;owned\x07\x1b[2Jy"
    out.write_text("a file\n")
    outcome = run_b70ctl(["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny", "--check", "smoke", "--out",
                          str(out), "--timeout", "5"])
    assert outcome.code == 2 and "\x1b" not in outcome.stdout + outcome.stderr
    assert re.search(r"--out \S*x\S*y: a file, not a directory", outcome.stderr), outcome.stderr


def test_model_manifest_refuses_a_link_before_hashing_anything(tmp_path, monkeypatch):
    """A link late in the listing is refused before the weights before it are read: none is hashed."""
    import b70ctl.models.manifest as manifest

    model = tmp_path / "model"
    model.mkdir()
    with open(model / "a-weights.safetensors", "wb") as sparse:
        sparse.truncate(2**30)
    (model / "z-config.json").symlink_to(tmp_path / "elsewhere.json")
    hashed: list[Path] = []
    monkeypatch.setattr(manifest, "sha256_file", lambda path: hashed.append(path) or "0" * 64)
    before = snapshot(tmp_path)
    outcome = run_b70ctl(["model", "manifest", str(model)])
    assert outcome.code == 2 and re.search(r"z-config\.json is a symbolic link", outcome.stderr), outcome.stderr
    assert hashed == []
    assert snapshot(tmp_path) == before


def test_an_ordinary_model_directory_is_still_hashed_whole(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "sub").mkdir()
    (model / "sub" / "w.bin").write_bytes(b"abc")
    outcome = run_b70ctl(["model", "manifest", str(model), "--json"])
    assert outcome.code == 0, outcome.stderr
    files = {f["path"]: f["sha256"] for f in json.loads(outcome.stdout)["manifests"][0]["files"]}
    assert files == {"config.json": hashlib.sha256(b"{}").hexdigest(), "sub/w.bin": hashlib.sha256(b"abc").hexdigest()}

