"""The roofline cost model, the GPU catalog and the ``sidecar cost`` command line."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from typer.testing import CliRunner

from cli.main import app
from study.cost import (
    GB,
    MB,
    MODES,
    STUDY_WORKLOAD,
    TB,
    TERA,
    CostInputError,
    MeasuredStep,
    ModelFacts,
    Peaks,
    TagTokens,
    UnknownGPUError,
    Workload,
    calibrate,
    decode_step_seconds,
    default_dtype,
    draft_config,
    find_gpu,
    forward_bytes,
    forward_flops,
    get_gpu,
    load_catalog,
    prefill_seconds,
    project,
    roofline_table,
    usd_per_million_tokens,
)
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_1_5B_CONFIG, QWEN2_5_7B_CONFIG
from study.report.measurements import Measurement

# Published shapes (the models' config.json on the Hugging Face hub); 7B and 1.5B as the cost model spells them.
QWEN_7B = QWEN2_5_7B_CONFIG
QWEN_1_5B = QWEN2_5_1_5B_CONFIG
QWEN_0_5B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
# The example, word for word, less the program name.
EXAMPLE = shlex.split(
    "sidecar cost roofline --weights-gb 3.09 --kv-full-mb 18 --kv-masked-mb 3.7 --bandwidth-tbs 2.0 "
    "--batches 1,16,32,64,128 --json"
)[1:]

runner = CliRunner()


@pytest.mark.parametrize(
    ("shapes", "kib_per_token"), [(QWEN_7B, 56), (QWEN_1_5B, 28), (QWEN_0_5B, 12)], ids=["7B", "1.5B", "0.5B"]
)
def test_kv_bytes_per_token_of_the_qwen_models(shapes: dict, kib_per_token: int) -> None:
    facts = ModelFacts.from_config(Qwen2Config(**shapes), dtype_bytes=2)
    assert facts.kv_bytes_per_token == kib_per_token * 1024


@pytest.mark.parametrize(
    ("config", "shapes"),
    [(Qwen2Config, QWEN_7B), (Qwen2Config, QWEN_1_5B), (Qwen2Config, QWEN_0_5B), (LlamaConfig, SMOLLM2_135M)],
    ids=["qwen-7B", "qwen-1.5B", "qwen-0.5B", "smollm2-135M"],
)
def test_parameter_count_matches_the_transformers_model(config: type, shapes: dict) -> None:
    # Building on the meta device allocates nothing, so the real shapes are cheap to instantiate.
    cfg = config(**shapes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert ModelFacts.from_config(cfg).parameters == sum(p.numel() for p in model.parameters())


def test_draft_weights_match_the_study() -> None:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B), dtype_bytes=2)
    assert facts.weight_bytes / GB == pytest.approx(3.09, abs=0.005)
    assert facts.weight_bytes_per_step == facts.weight_bytes  # tied: the LM head reads the whole table


def test_an_untied_input_embedding_is_not_streamed_per_step() -> None:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_7B), dtype_bytes=2)
    embedding_bytes = 152064 * 3584 * 2
    assert facts.weight_bytes - facts.weight_bytes_per_step == embedding_bytes
    assert facts.weight_bytes / GB == pytest.approx(15.23, abs=0.01)


def test_fp32_doubles_weights_and_kv() -> None:
    bf16 = ModelFacts.from_config(Qwen2Config(**QWEN_0_5B), dtype_bytes=2)
    fp32 = ModelFacts.from_config(Qwen2Config(**QWEN_0_5B), dtype_bytes=4)
    assert fp32.weight_bytes == 2 * bf16.weight_bytes
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token


def test_unmodelled_configs_are_refused() -> None:
    with pytest.raises(CostInputError, match="not modelled"):
        ModelFacts.from_config(Qwen2Config(**QWEN_0_5B, use_sliding_window=True))
    gpt2 = type("Config", (), {"model_type": "gpt2"})()
    with pytest.raises(CostInputError, match="gpt2"):
        ModelFacts.from_config(gpt2)


def test_facts_from_a_saved_config_file(tmp_path: Path) -> None:
    Qwen2Config(**QWEN_0_5B).save_pretrained(tmp_path)
    from_folder = ModelFacts.from_config_file(tmp_path)
    from_file = ModelFacts.from_config_file(tmp_path / "config.json")
    assert from_folder == from_file == ModelFacts.from_config(Qwen2Config(**QWEN_0_5B))
    with pytest.raises(CostInputError, match="no model config"):
        ModelFacts.from_config_file(tmp_path / "missing")


def test_draft_config_of_the_tiny_pair_is_its_draft_without_files() -> None:
    from sidecar.models.tiny import tiny_pair

    facts = ModelFacts.from_config(draft_config("tiny"))
    draft = tiny_pair().draft
    assert facts.parameters == draft.num_parameters()
    # its fields, read without torch, are those of the draft's own config (KV bytes and FLOP shapes included)
    assert facts == ModelFacts.from_config(draft.config)


def test_draft_config_of_a_spec_reads_only_the_drafts_config(tmp_path: Path) -> None:
    Qwen2Config(**QWEN_0_5B).save_pretrained(tmp_path / "draft")  # a config.json and no weights
    config = draft_config(f"{tmp_path / 'target'},{tmp_path / 'draft'}")
    assert ModelFacts.from_config(config) == ModelFacts.from_config(Qwen2Config(**QWEN_0_5B))


@pytest.mark.parametrize(
    "pair", ["no-such-pair", "/nowhere/target,/nowhere/draft"], ids=["unknown name", "missing path"]
)
def test_draft_config_that_is_not_here_says_so(pair: str) -> None:
    with pytest.raises(CostInputError, match="not on this machine"):
        draft_config(pair)


def test_default_dtype_is_what_load_pair_picks_per_device() -> None:
    assert default_dtype("cuda") == ("bfloat16", 2)
    assert default_dtype("cpu") == ("float32", 4)


def test_tag_tokens_from_measured_counts_keep_the_template_estimates() -> None:
    # the target's prompt is system + document + instruction: the document is what the template leaves
    tokens = TagTokens.from_measured(main_prompt=722.75, summary=87.75, tags=27.6)
    assert (tokens.document, tokens.summary, tokens.tags) == (723 - 14 - 21, 88, 28)
    assert (tokens.system, tokens.instruction, tokens.sidecar_instruction) == (14, 21, 25)
    assert TagTokens.from_measured(main_prompt=10, summary=5, tags=0.2).document == 0
    # where the ledger counted them, the sidecar's masked instruction and its feed are the run's own
    counted = TagTokens.from_measured(main_prompt=722.75, summary=87.75, tags=27.6, sidecar_instruction=31.5,
                                      sidecar_feed=4.2)
    assert (counted.sidecar_instruction, counted.sidecar_feed) == (32, 4)
    assert TagTokens.from_measured(main_prompt=100, summary=5, tags=3, sidecar_feed=0).sidecar_feed == 1


def test_catalog_entries_are_complete_and_positive() -> None:
    catalog = load_catalog()
    assert {"T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100 SXM", "H200"} <= set(catalog)
    for gpu in catalog.values():
        assert gpu.bandwidth_gb_s > 0 and gpu.usd_per_hour > 0 and gpu.source
    assert catalog["A100-80GB"].bandwidth_gb_s == 2039
    assert catalog["H200"].usd_per_hour_quoted == (2.5, 7.0)


def test_catalog_compute_peaks_are_dense_figures_with_a_source() -> None:
    catalog = load_catalog()
    for gpu in catalog.values():
        assert gpu.dense_tflops > 0 and gpu.tflops_dtype in ("bf16", "fp16")
        assert "Compute:" in gpu.source
        assert gpu.flops_s == gpu.dense_tflops * TERA
    # Datasheets star their sparse figures, twice the dense ones: 1,979 for an H100 SXM or H200, 624 for an A100.
    assert catalog["H100 SXM"].dense_tflops == catalog["H200"].dense_tflops == 989
    assert catalog["A100-40GB"].dense_tflops == catalog["A100-80GB"].dense_tflops == 312
    assert (catalog["L4"].dense_tflops, catalog["T4"].tflops_dtype) == (121, "fp16")  # Turing has no bf16 cores
    # The H200 NVL has the H200's bandwidth but a lower compute peak: another part.
    assert find_gpu("NVIDIA H200 NVL", catalog) is None


def test_gpus_are_found_by_catalog_name_or_device_name() -> None:
    catalog = load_catalog()
    assert find_gpu("h100 sxm", catalog) is catalog["H100 SXM"]
    assert find_gpu("Tesla T4", catalog) is catalog["T4"]
    assert find_gpu("NVIDIA H200", catalog) is catalog["H200"]
    # A different part with a different bandwidth must not borrow the SXM figure.
    assert find_gpu("NVIDIA A100 80GB PCIe", catalog) is None
    with pytest.raises(UnknownGPUError, match="known: T4, L4"):
        get_gpu("V100", catalog)


def test_tag_tokens_order_the_modes() -> None:
    tokens = TagTokens(document=600, summary=70)
    standalone, evicted, attended = (tokens.mean_context(m) for m in ("standalone", "sidecar", "sidecar_attended"))
    assert standalone < evicted < attended
    assert attended - evicted == 600
    assert evicted - standalone == tokens.instruction
    assert standalone == tokens.system + 70 + tokens.sidecar_instruction + (tokens.tags - 1) / 2
    with pytest.raises(CostInputError):
        TagTokens(document=-1, summary=70)


def _counted_flops(model: torch.nn.Module, **inputs: object) -> int:
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_forward_flops_match_torchs_count_of_a_real_forward(tied: bool) -> None:
    # A small Qwen2 with eager attention, so that every FLOP is a matmul torch's counter sees.
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=300, tie_word_embeddings=tied,
                         attn_implementation="eager")  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    facts = ModelFacts.from_config(config)
    batch, prompt = 3, 7
    ids = torch.randint(0, 300, (batch, prompt))
    # A prefill whose LM head runs at the last position only, as the engine's does.
    counted = _counted_flops(model, input_ids=ids, logits_to_keep=1)
    # Eager attention also scores the masked future keys: the causal formula leaves those out.
    masked_pairs = prompt * prompt - prompt * (prompt + 1) / 2
    masked_flops = 4 * facts.layers * facts.attention_width * batch * masked_pairs
    assert counted == forward_flops(facts, batch, prompt, 0) + masked_flops
    # A decode step over the prompt's cache: one new token attends the prompt and itself, nothing is masked.
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).cache
    counted = _counted_flops(model, input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert counted == forward_flops(facts, batch, 1, prompt)


def test_a_forward_is_compute_bound_or_bandwidth_bound_whichever_is_longer() -> None:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    h100 = load_catalog()["H100 SXM"]

    def regimes(batch: int, tokens: int, context: int) -> tuple[float, float]:
        return (forward_flops(facts, batch, tokens, context) / h100.flops_s,
                forward_bytes(facts, batch, tokens, context) / h100.bandwidth_bytes_s)  # fmt: skip

    # A few short prompts stay bandwidth-bound: the weights are read once whatever the batch.
    compute, memory = regimes(1, 4, 0)
    assert compute < memory and prefill_seconds(facts, h100, 1, 4) == memory
    # A batch of 100-token prompts is compute-bound.
    compute, memory = regimes(64, 100, 0)
    assert compute > 5 * memory and prefill_seconds(facts, h100, 64, 100) == compute
    # Decode steps at the batch sizes sidecar runs are bandwidth-bound, and a decode step is a one-token forward.
    compute, memory = regimes(128, 1, 600)
    assert compute < memory and decode_step_seconds(facts, h100, 128, 600) == memory
    assert decode_step_seconds(facts, h100, 8, 300) == prefill_seconds(facts, h100, 8, 1, 300)
    # FLOPs of a long prompt are about 2 x parameters x tokens.
    assert forward_flops(facts, 1, 2000, 0) == pytest.approx(2 * facts.parameters * 2000, rel=0.2)
    with pytest.raises(CostInputError):
        forward_flops(facts, 0, 1, 0)
    # A device outside the catalog is given by its two peaks.
    peaks = Peaks(h100.bandwidth_bytes_s, h100.flops_s)
    assert prefill_seconds(facts, peaks, 64, 100) == prefill_seconds(facts, h100, 64, 100)
    with pytest.raises(CostInputError):
        Peaks(3.35 * TB, 0)


def test_prefilling_a_summary_costs_about_as_much_as_its_tag_decode_on_an_h100() -> None:
    # The estimate: a 1.5B draft on an H100 at batch 64 prefills a ~100-token summary for about the price
    # of decoding its ~28 tag tokens. From the catalog's figures and the draft's shapes alone:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    h100 = load_catalog()["H100 SXM"]
    tokens = TagTokens(document=600, summary=100, tags=28)
    standalone = Workload.from_model(facts, tokens, "1.5B").tagging_time("standalone", 64, h100)
    assert 0.3 < standalone.prefill_s / standalone.decode_s < 3
    # The same from the two primitives a trace replay calls.
    prompt, _ = tokens.prefill("standalone")
    prefill = prefill_seconds(facts, h100, 64, prompt)
    decode = sum(decode_step_seconds(facts, h100, 64, prompt + i) for i in range(tokens.tags - 1))
    assert 0.3 < prefill / decode < 3
    assert standalone.prefill_s == prefill


def test_the_sidecar_feeds_a_few_tokens_where_the_standalone_prefills_its_prompt() -> None:
    tokens = TagTokens(document=600, summary=70, sidecar_feed=3)
    assert tokens.prefill("standalone") == (tokens.system + 70 + tokens.sidecar_instruction, 0)
    assert tokens.prefill("sidecar") == (3, tokens.prompt("sidecar") - 3)
    assert tokens.prefill("sidecar_attended") == (3, tokens.prompt("sidecar") - 3 + 600)
    assert tokens.mean_context("sidecar") == tokens.prompt("sidecar") + (tokens.tags - 1) / 2
    with pytest.raises(CostInputError, match="sidecar_feed"):
        TagTokens(document=0, summary=0, system=0, instruction=0, sidecar_instruction=0, sidecar_feed=1)


def test_the_tagging_phase_is_a_prefill_then_a_decode_step_per_further_tag() -> None:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    a100 = load_catalog()["A100-80GB"]
    tokens = TagTokens(document=600, summary=70)
    workload = Workload.from_model(facts, tokens, "1.5B")
    rows = {r.mode: r for r in project(workload, a100, [64])}
    for mode, row in rows.items():
        time = workload.tagging_time(mode, 64, a100)
        assert row.prefill_ms == pytest.approx(time.prefill_s * 1000)
        assert row.decode_ms == pytest.approx((tokens.tags - 1) * row.ms_per_step)
        assert row.tag_tokens_per_s == pytest.approx(64 * tokens.tags / time.seconds)
        assert row.usd_per_million_tag_tokens == pytest.approx(usd_per_million_tokens(2.5, row.tag_tokens_per_s))
    # The standalone prefills its whole prompt; a sidecar feeds a few tokens, attended or not.
    assert rows["standalone"].prefill_ms > 5 * rows["sidecar_attended"].prefill_ms > 5 * rows["sidecar"].prefill_ms
    # Evicting the document takes its KV entries off every decode step.
    assert rows["sidecar_attended"].decode_ms > 1.2 * rows["sidecar"].decode_ms
    # Prefill included, an evicted sidecar tag token is cheaper than a standalone one here.
    assert rows["sidecar"].tag_tokens_per_s > rows["standalone"].tag_tokens_per_s
    # Without the draft's shape nothing but the decode step is priced.
    bare = project(Workload("bytes", 3.09 * GB, {"sidecar": 3.7 * MB}, ""), a100, [64])[0]
    assert (bare.prefill_ms, bare.tag_tokens_per_s, bare.usd_per_million_tag_tokens) == (None, None, None)


def test_a_sidecar_is_charged_its_instructions_share_of_the_main_draft_prefill() -> None:
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    h100 = load_catalog()["H100 SXM"]
    tokens = TagTokens(document=600, summary=70, sidecar_instruction=25)
    workload = Workload.from_model(facts, tokens, "1.5B")
    # the main row's draft prefill holds the target's prompt and the masked instruction: 14 + 600 + 21 + 25
    assert tokens.main_prefill == 660
    main_prefill = prefill_seconds(facts, h100, 64, 660)
    for mode in ("sidecar", "sidecar_attended"):
        time = workload.tagging_time(mode, 64, h100)
        # the ledger's rule: a forward's seconds shared in proportion to tokens
        assert time.instruction_s == pytest.approx(main_prefill * 25 / 660)
        assert time.seconds == pytest.approx(time.prefill_s + time.decode_s + time.instruction_s)
    assert workload.tagging_time("standalone", 64, h100).instruction_s == 0
    rows = {row.mode: row for row in project(workload, h100, [64])}
    assert rows["sidecar"].instruction_ms == pytest.approx(main_prefill * 25 / 660 * 1000)
    assert rows["standalone"].instruction_ms == 0
    # with no instruction to hide, there is no line
    plain = Workload.from_model(facts, TagTokens(document=600, summary=70, sidecar_instruction=0), "x")
    assert plain.tagging_time("sidecar", 64, h100).instruction_s == 0


def test_the_study_workload_prices_flops_from_the_study_drafts_shapes() -> None:
    assert STUDY_WORKLOAD.facts == ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    # Its token counts give its KV figures at 28 KiB per token.
    for mode, kv_bytes in STUDY_WORKLOAD.kv_bytes_per_request.items():
        assert STUDY_WORKLOAD.tokens.mean_context(mode) * 28 * 1024 == pytest.approx(kv_bytes, rel=0.03)


def test_step_bytes_add_the_batch_kv_to_the_weights() -> None:
    assert STUDY_WORKLOAD.step_bytes("sidecar_attended", 128) == pytest.approx(3.09 * GB + 128 * 18 * MB)
    assert STUDY_WORKLOAD.step_seconds("sidecar", 1, 2 * TB) == pytest.approx((3.09 * GB + 3.7 * MB) / (2 * TB))


def test_projection_is_monotonic_in_batch_size() -> None:
    gpu = load_catalog()["A10G"]
    rows = project(STUDY_WORKLOAD, gpu, [1, 2, 4, 8, 16, 32, 64, 128])
    for mode in MODES:
        line = [r for r in rows if r.mode == mode]
        times = [r.ms_per_step for r in line]
        rates = [r.tokens_per_s for r in line]
        prices = [r.usd_per_million_tokens for r in line]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert rates == sorted(rates) and len(set(rates)) == len(rates)
        assert prices == sorted(prices, reverse=True)
    by_key = {(r.mode, r.batch): r for r in rows}
    for batch in (1, 128):
        assert by_key[("standalone", batch)].ms_per_step < by_key[("sidecar", batch)].ms_per_step
        assert by_key[("sidecar", batch)].ms_per_step < by_key[("sidecar_attended", batch)].ms_per_step


def test_price_per_million_tokens_by_hand() -> None:
    t4 = load_catalog()["T4"]
    row = next(r for r in project(STUDY_WORKLOAD, t4, [1]) if r.mode == "sidecar")
    seconds = (3.09e9 + 3.7e6) / 320e9
    assert row.ms_per_step == pytest.approx(seconds * 1000)
    assert row.usd_per_million_tokens == pytest.approx(0.59 / 3600 * seconds * 1e6)
    assert usd_per_million_tokens(3.6, 1000) == pytest.approx(1.0)


def test_eviction_speedup_grows_with_batch_and_vanishes_at_batch_one() -> None:
    rows = roofline_table(STUDY_WORKLOAD, 2 * TB, [1, 16, 32, 64, 128])
    speedups = [r.speedup_pct for r in rows]
    assert speedups == sorted(speedups) and len(set(speedups)) == len(speedups)
    assert speedups[0] < 1  # the study: at batch 1 masking gains nothing
    for row in rows:
        assert row.speedup_pct == pytest.approx((row.full_ms_per_step / row.masked_ms_per_step - 1) * 100)


def test_speedup_does_not_depend_on_bandwidth() -> None:
    slow = roofline_table(STUDY_WORKLOAD, 0.3 * TB, [64])[0]
    fast = roofline_table(STUDY_WORKLOAD, 4.8 * TB, [64])[0]
    assert slow.speedup_pct == pytest.approx(fast.speedup_pct)
    assert slow.masked_ms_per_step == pytest.approx(16 * fast.masked_ms_per_step)


def test_workload_rejects_non_positive_sizes() -> None:
    with pytest.raises(CostInputError):
        Workload("w", 0, {"sidecar": 1.0}, "")
    with pytest.raises(CostInputError):
        Workload("w", 1.0, {"sidecar": -1.0}, "")
    with pytest.raises(CostInputError):
        roofline_table(STUDY_WORKLOAD, 2 * TB, [0, 4])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_cost_input_is_finite_or_refused_naming_it(value: float) -> None:
    checks = {
        "weight bytes per step": lambda: Workload("w", value, {"sidecar": 1.0}, ""),
        "KV bytes per request for sidecar": lambda: Workload("w", 1.0, {"sidecar": value}, ""),
        "bandwidth": lambda: roofline_table(STUDY_WORKLOAD, value, [4]),
        "FLOP/s": lambda: Peaks(2 * TB, value),
        "measured mean summary tokens": lambda: TagTokens.from_measured(600, value, 20),
        "H200 sidecar ms_per_step": lambda: MeasuredStep("H200", "sidecar", 8, ms_per_step=value),
        "a forward's context": lambda: forward_flops(QWEN2_5_1_5B, 1, 1, value),
    }
    for field, check in checks.items():
        with pytest.raises(CostInputError, match=f"{re.escape(field)} must be a finite number"):
            check()


@pytest.mark.parametrize("value", [1.9, 1.2, 2.0, "2", True], ids=["1.9", "1.2", "2.0", "string", "bool"])
def test_every_integer_cost_input_is_an_integer_not_a_float_made_one(value: object) -> None:
    checks = {
        "document tokens": lambda: TagTokens(document=value, summary=50),
        "batch sizes": lambda: roofline_table(STUDY_WORKLOAD, 2 * TB, [value]),
        "batch": lambda: MeasuredStep("H200", "sidecar", value, ms_per_step=1.0),
        "dtype_bytes": lambda: ModelFacts.from_config(Qwen2Config(**QWEN_1_5B), value),
        "a forward's batch": lambda: forward_flops(QWEN2_5_1_5B, value, 1, 0.0),
    }
    for field, check in checks.items():
        with pytest.raises(CostInputError, match=f"{re.escape(field)} must be an integer, got"):
            check()


@pytest.mark.parametrize("field", ["bandwidth_gb_s", "dense_tflops", "usd_per_hour"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1", "0", '"fast"'])
def test_a_catalog_entry_that_is_not_finite_and_positive_is_refused_naming_it(tmp_path: Path, field: str,
                                                                                value: str) -> None:
    entry = {"name": "X1", "bandwidth_gb_s": 1000, "dense_tflops": 100, "tflops_dtype": "bf16", "usd_per_hour": 2.0,
             "source": "test"}
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [entry]}).replace(f'"{field}": {json.dumps(entry[field])}',
                                                          f'"{field}": {value}'))
    with pytest.raises(CostInputError, match=f"catalog entry 'X1' {field} must be"):
        load_catalog(path)


def test_a_measured_batch_size_of_1_9_is_refused_not_read_as_1() -> None:
    row = {"mode": "sidecar", "gpu_type": "H200", "phase": "main", "batch_size": 1.9, "tokens": 10, "seconds": 1}
    with pytest.raises(CostInputError, match="positive integer batch_size"):
        Measurement.from_row(row)
    with pytest.raises(CostInputError, match="seconds must be a finite number"):
        Measurement.from_row(row | {"batch_size": 2, "seconds": float("inf")})


def test_calibration_divides_measured_by_projected() -> None:
    catalog = load_catalog()
    projected_ms = STUDY_WORKLOAD.step_seconds("sidecar", 32, catalog["H200"].bandwidth_bytes_s) * 1000
    measured = [
        MeasuredStep("NVIDIA H200", "sidecar", 32, ms_per_step=2 * projected_ms),
        # Given as whole-batch tokens/s: 32 tokens per step at 3x the projected step time.
        MeasuredStep("H200", "sidecar", 32, tokens_per_s=32 / (3 * projected_ms / 1000)),
        MeasuredStep("Intel Xeon CPU", "sidecar", 4, ms_per_step=300.0),  # not catalogued: skipped
    ]
    rows = calibrate(measured, STUDY_WORKLOAD, catalog)
    assert [r.catalog_gpu for r in rows] == ["H200", "H200"]
    assert [r.measured_over_projected for r in rows] == pytest.approx([2.0, 3.0])


def test_cli_example_command_prints_the_json_contract() -> None:
    result = runner.invoke(app, EXAMPLE)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["batch"] for r in rows] == [1, 16, 32, 64, 128]
    last = rows[-1]
    assert last["full_gb_per_step"] == pytest.approx(3.09 + 128 * 0.018)
    assert last["masked_gb_per_step"] == pytest.approx(3.09 + 128 * 0.0037)
    assert last["full_ms_per_step"] == pytest.approx(5.394 / 2.0)
    assert last["masked_ms_per_step"] == pytest.approx(3.5636 / 2.0)
    assert last["speedup_pct"] == pytest.approx((5.394 / 3.5636 - 1) * 100)
    assert rows[0]["speedup_pct"] < 1
    assert [r["speedup_pct"] for r in rows] == sorted(r["speedup_pct"] for r in rows)
    assert last["usd_per_million_masked"] is None  # no price without --gpu


def test_cli_takes_bandwidth_and_price_from_the_catalog() -> None:
    args = ["cost", "roofline", "--weights-gb", "3.09", "--kv-full-mb", "18", "--kv-masked-mb", "3.7"]
    result = runner.invoke(app, [*args, "--kv-standalone-mb", "3", "--gpu", "T4", "--batches", "1,64", "--json"])
    assert result.exit_code == 0, result.output
    first = json.loads(result.stdout)[0]
    assert first["masked_ms_per_step"] == pytest.approx((3.09e9 + 3.7e6) / 320e9 * 1000)
    assert first["standalone_gb_per_step"] == pytest.approx(3.093)
    assert first["usd_per_million_masked"] == pytest.approx(0.59 / 3600 / first["masked_tokens_per_s"] * 1e6)


def test_cli_derives_the_workload_from_a_draft_config(tmp_path: Path) -> None:
    Qwen2Config(**QWEN_1_5B).save_pretrained(tmp_path)
    args = shlex.split("cost roofline --doc-tokens 600 --summary-tokens 70 --bandwidth-tbs 2 --batches 1,8 --json")
    result = runner.invoke(app, [*args, "--pair-config", str(tmp_path / "config.json")])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)[1]
    facts = ModelFacts.from_config(Qwen2Config(**QWEN_1_5B))
    tokens = TagTokens(document=600, summary=70)
    assert row["masked_gb_per_step"] * GB == pytest.approx(
        facts.weight_bytes + 8 * tokens.mean_context("sidecar") * 28 * 1024
    )
    assert row["full_gb_per_step"] - row["masked_gb_per_step"] == pytest.approx(8 * 600 * 28 * 1024 / GB)
    assert row["standalone_ms_per_step"] < row["masked_ms_per_step"]


def test_cli_prints_a_table_without_json() -> None:
    result = runner.invoke(app, EXAMPLE[:-1])
    assert result.exit_code == 0, result.output
    assert "eviction" in result.stdout and "51.36" in result.stdout


def test_cli_shows_prefill_and_decode_with_a_pair_config(tmp_path: Path) -> None:
    Qwen2Config(**QWEN_1_5B).save_pretrained(tmp_path)
    args = ["cost", "roofline", "--pair-config", str(tmp_path), "--doc-tokens", "600", "--summary-tokens", "100",
            "--tag-tokens", "28", "--batches", "1,64"]  # fmt: skip
    result = runner.invoke(app, [*args, "--gpu", "H100 SXM", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    workload = Workload.from_model(ModelFacts.from_config(Qwen2Config(**QWEN_1_5B)),
                                   TagTokens(document=600, summary=100, tags=28), "x")  # fmt: skip
    time = workload.tagging_time("standalone", 64, load_catalog()["H100 SXM"])
    assert rows[1]["standalone_prefill_ms"] == pytest.approx(time.prefill_s * 1000)
    assert rows[1]["standalone_decode_ms"] == pytest.approx(time.decode_s * 1000)
    assert rows[1]["masked_prefill_ms"] < rows[1]["standalone_prefill_ms"] / 5
    assert rows[1]["sidecar_saving_pct"] > 0
    # At batch 1 both prefills only stream the weights: the sidecar saves next to nothing.
    assert abs(rows[0]["sidecar_saving_pct"]) < 1
    # A device outside the catalog prices the prefill with --tflops, the same as the catalog entry.
    custom = runner.invoke(app, [*args, "--bandwidth-tbs", "3.35", "--tflops", "989", "--json"])
    assert json.loads(custom.stdout)[1]["standalone_prefill_ms"] == pytest.approx(rows[1]["standalone_prefill_ms"])
    table = runner.invoke(app, [*args, "--gpu", "H100 SXM"])
    assert "prefill +" in table.stdout and "instr." in table.stdout
    # batch 64: standalone prefill + decode, and the sidecar's instruction line beside the evicted one's cells
    [*_, line] = [line for line in table.stdout.splitlines() if line.strip().startswith("64 ")]
    assert f"{rows[1]['standalone_prefill_ms']:.2f} + {rows[1]['standalone_decode_ms']:.2f}" in line
    assert f" {rows[1]['masked_instruction_ms']:.2f} " in line
    assert rows[1]["masked_instruction_ms"] == rows[1]["full_instruction_ms"] > 0


def test_cli_without_a_shape_or_flops_prices_no_prefill(tmp_path: Path) -> None:
    result = runner.invoke(app, EXAMPLE)
    assert {r["standalone_prefill_ms"] for r in json.loads(result.stdout)} == {None}
    assert "--pair-config" in runner.invoke(app, EXAMPLE[:-1]).stdout
    Qwen2Config(**QWEN_1_5B).save_pretrained(tmp_path)
    args = ["cost", "roofline", "--pair-config", str(tmp_path), "--doc-tokens", "600", "--summary-tokens", "100"]
    result = runner.invoke(app, [*args, "--bandwidth-tbs", "2", "--json"])
    assert {r["masked_prefill_ms"] for r in json.loads(result.stdout)} == {None}
    assert "--tflops" in runner.invoke(app, [*args, "--bandwidth-tbs", "2"]).stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "V100"], "unknown GPU 'V100'; known: T4, L4, A10G"),
        (["--gpu", "T4", "--bandwidth-tbs", "2"], "exactly one of --gpu and --bandwidth-tbs"),
        (["--bandwidth-tbs", "0"], "--bandwidth-tbs must be positive"),
        (["--bandwidth-tbs", "2", "--kv-full-mb", "-18"], "--kv-full-mb must be positive"),
        (["--bandwidth-tbs", "2", "--batches", "0,4"], "batch sizes must be an integer of at least 1, got 0"),
        (["--bandwidth-tbs", "2", "--batches", "one"], "comma-separated integers"),
        (["--bandwidth-tbs", "2", "--pair-config", "x"], "either --pair-config or"),
        (["--bandwidth-tbs", "2", "--tflops", "0"], "--tflops must be positive"),
        (["--gpu", "T4", "--tflops", "65"], "--tflops goes with --bandwidth-tbs"),
        # a check written `<= 0` let these through: NaN and infinity in every float option
        (["--bandwidth-tbs", "nan"], "--bandwidth-tbs must be a finite number, got nan"),
        (["--bandwidth-tbs", "inf"], "--bandwidth-tbs must be a finite number, got inf"),
        (["--bandwidth-tbs", "2", "--tflops", "inf"], "--tflops must be a finite number"),
        (["--bandwidth-tbs", "2", "--weights-gb", "inf"], "--weights-gb must be a finite number"),
        (["--bandwidth-tbs", "2", "--kv-full-mb", "nan"], "--kv-full-mb must be a finite number"),
        (["--bandwidth-tbs", "2", "--kv-masked-mb", "-inf"], "--kv-masked-mb must be a finite number"),
        (["--bandwidth-tbs", "2", "--kv-standalone-mb", "NaN"], "--kv-standalone-mb must be a finite number"),
        (["--bandwidth-tbs", "2", "--batches", "1.9"], "comma-separated integers"),
    ],
)
def test_cli_errors_say_what_is_wrong(args: list[str], message: str) -> None:
    base = {"--weights-gb": "3.09", "--kv-full-mb": "18", "--kv-masked-mb": "3.7"}
    for flag in args[::2]:
        base.pop(flag, None)
    command = ["cost", "roofline", *(x for kv in base.items() for x in kv), *args]
    result = runner.invoke(app, command)
    assert result.exit_code == 2
    assert message in result.stderr


def test_cli_pair_config_needs_token_counts(tmp_path: Path) -> None:
    result = runner.invoke(app, ["cost", "roofline", "--pair-config", str(tmp_path), "--gpu", "T4"])
    assert result.exit_code == 2
    assert "--doc-tokens and --summary-tokens" in result.stderr


def test_cli_lists_the_catalog() -> None:
    result = runner.invoke(app, ["cost", "gpus", "--json"])
    assert result.exit_code == 0, result.output
    assert [g["name"] for g in json.loads(result.stdout)] == list(load_catalog())
