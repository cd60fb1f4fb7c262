"""Kernel choice and preflight on recorded machine descriptions (no GPU needed) and on this CPU."""

import json

import pytest
import torch

from hf_pretrain import PretrainConfig, PretrainForCausalLM, PretrainTrainer, get_preset
from hf_pretrain.data import PackedDocumentCollator
from hf_pretrain.modeling.attention import Environment, LayerNeed, best_backend, choose_backend
from hf_pretrain.preflight.attention import AttentionFallbackError, attention_preflight, enforce_attention_policy
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset

NO_KERNELS = {"flash_attn_interface": None, "flash_attn": None}
FA2_ONLY = {"flash_attn_interface": None, "flash_attn": "2.8.3"}
FA3 = {"flash_attn_interface": "3.0.0", "flash_attn": "2.8.3"}
H100 = dict(device="cuda", capability=(9, 0))
A100 = dict(device="cuda", capability=(8, 0))
GB10 = dict(device="cuda", capability=(12, 1))
WINDOWED = get_preset("gpt2-124m", window_pattern="SSSL", sliding_window=512, max_position_embeddings=2048)


def env(machine, kernels, dtype=torch.bfloat16, training=True, flex=True):
    return Environment(machine["device"], dtype, training, machine.get("capability"), kernels, flex)


def plan(machine, kernels, packed=False, config=WINDOWED, **kw):
    report = attention_preflight(config, 2048, env(machine, kernels, **kw), packed)
    return {r.layer_type: r for r in report.rows}, report


@pytest.mark.parametrize(
    "machine, kernels, full, window",
    [
        (H100, FA3, "flash_attention_3", "flash_attention_3"),
        (H100, FA2_ONLY, "flash_attention_2", "flash_attention_2"),
        (H100, NO_KERNELS, "sdpa", "flex_attention"),  # flex keeps windows sparse when FA is missing
        (A100, FA3, "flash_attention_2", "flash_attention_2"),  # FA3 is Hopper-only
        (GB10, FA2_ONLY, "flash_attention_2", "flash_attention_2"),
        ({"device": "cpu"}, FA3, "sdpa", "sdpa"),  # no FA on CPU, and flex cannot train there
    ],
)
def test_auto_picks_the_fastest_kernel_each_layer_type_can_use(machine, kernels, full, window):
    rows, _ = plan(machine, kernels)
    assert rows["full_attention"].backend == full and rows["sliding_attention"].backend == window


def test_field_notes_failure_fa3_missing_and_no_sparse_kernel_is_priced_and_warned():
    # FlashAttention 3 missing and no flex: SDPA does the windows with a dense mask.
    rows, report = plan(H100, NO_KERNELS, flex=False)
    window = rows["sliding_attention"]
    assert (window.backend, window.efficient, window.best_backend) == ("sdpa", False, "flash_attention_3")
    assert window.attention_work_vs_best == pytest.approx(2048 / ((512 * 513 / 2 + 1536 * 512) / 2048))  # ~4.6x
    assert report.step_cost_vs_best > 1.05
    text = " ".join(report.warnings)
    assert "flash_attn_interface is not installed" in text and "window_pattern='L'" in text
    assert "4.6x the attention work" in text


def test_dtype_that_blocks_flash_attention_is_named():
    rows, report = plan(H100, FA3, dtype=torch.float32)
    assert "needs bf16/fp16 activations (dtype is float32)" in rows["full_attention"].passed_over["flash_attention_3"]
    assert rows["full_attention"].best_backend == "sdpa"  # fp32 on this GPU: SDPA is the best there is
    assert rows["sliding_attention"].backend == "flex_attention" and not report.warnings


def test_packed_documents_make_dense_sdpa_inefficient_even_on_full_layers():
    need = LayerNeed("full_attention", None, packed=True)
    cpu = env({"device": "cpu"}, NO_KERNELS, dtype=torch.float32)
    assert choose_backend(need, cpu).backend == "sdpa" and not choose_backend(need, cpu).efficient
    gpu = env(H100, NO_KERNELS)
    assert choose_backend(need, gpu).backend == "flex_attention"
    assert best_backend(need, gpu).backend == "flash_attention_3"


def test_requested_backend_that_cannot_run_is_a_clear_error():
    config = small_config(attention_backend="flash_attention_2")
    with pytest.raises(ValueError, match="flash_attention_2.*cannot run.*needs a CUDA GPU"):
        attention_preflight(config, 128, env({"device": "cpu"}, NO_KERNELS, dtype=torch.float32), False)


def test_policies_write_preflight_json_and_warn_or_refuse(tmp_path, capsys):
    _, report = plan(H100, NO_KERNELS, flex=False)
    enforce_attention_policy(report, "warn", tmp_path / "warn")
    out = capsys.readouterr().out
    assert "WARNING: window 512 layers run on sdpa instead of flash_attention_3" in out
    saved = json.loads((tmp_path / "warn" / "preflight.json").read_text())["attention"]
    assert {r["layer_type"]: r["backend"] for r in saved["rows"]} == {
        "sliding_attention": "sdpa",
        "full_attention": "sdpa",
    }
    assert saved["rows"][0]["reason"]
    with pytest.raises(AttentionFallbackError, match="pip install flash-attn|flash_attn_interface"):
        enforce_attention_policy(report, "error", tmp_path / "error")
    assert (tmp_path / "error" / "preflight.json").exists()
    enforce_attention_policy(report, "ignore", tmp_path / "ignore")
    assert capsys.readouterr().out == "" and (tmp_path / "ignore" / "preflight.json").exists()
    with pytest.raises(ValueError, match="attn_fallback='loud'"):
        enforce_attention_policy(report, "loud")


def trainer(tmp_path, backend, policy):
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(window_pattern="SL", sliding_window=8, attention_backend=backend))
    args = quick_args(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=4,
        attn_fallback=policy,
    )
    return PretrainTrainer(model=model, args=args, train_dataset=dataset(), data_collator=PackedDocumentCollator(1))


def test_trainer_runs_the_preflight_and_repeats_the_warning_in_the_first_logs(tmp_path):
    t = trainer(tmp_path, "eager", "warn")  # eager where SDPA is the best kernel here
    t.train()
    assert json.loads((tmp_path / "preflight.json").read_text())["attention"]["packed"] is True
    first, second = [h for h in t.state.log_history if "loss" in h][:2]
    # On this CPU SDPA also needs a dense mask for packed rows: same FLOPs, slower kernel.
    assert "eager instead of sdpa" in first["attention_fallback"] and first["attention_step_cost_vs_best"] == 1.0
    assert "attention_fallback" not in second
    assert {c.backend for c in t.model.attention_plan.values()} == {"eager"}


def test_trainer_refuses_to_start_under_error_policy(tmp_path):
    with pytest.raises(AttentionFallbackError):
        trainer(tmp_path, "eager", "error").train()
    auto = trainer(tmp_path / "auto", "auto", "error")
    auto.train()  # SDPA is the best kernel on this CPU: nothing to refuse
    assert auto.state.global_step == 3 and not auto.attention_report.warnings


def test_doctor_table_on_this_machine():
    config = PretrainConfig(**small_config(window_pattern="SSSL", sliding_window=32).to_diff_dict())
    report = attention_preflight(config, 256, Environment.detect("cpu", torch.float32, True), packed=True)
    table = report.table()
    assert "3 x window 32" in table and "1 x full" in table and "attention is" in table
    assert "dense mask does" in table  # the CPU caveat is stated, not hidden


def test_the_trainer_plans_attention_once_reports_that_plan_and_the_model_runs_it(tmp_path, monkeypatch):
    from hf_pretrain.modeling import attention, model
    from hf_pretrain.preflight import attention as preflight
    from hf_pretrain.training import wiring

    plans = []

    def counted(*args, **kwargs):
        plans.append(attention.plan_attention(*args, **kwargs))
        return plans[-1]

    for module in (wiring, preflight, model):  # every place that could plan: the trainer, the preflight, the model
        monkeypatch.setattr(module, "plan_attention", counted)
    t = trainer(tmp_path, "auto", "warn")
    t.train()
    assert len(plans) == 1, "the attention plan was computed more than once in one run"
    assert t.model.attention_plan is plans[0]  # pinned: the training forwards never re-planned
    assert {r.layer_type: r.backend for r in t.attention_report.rows} == {k: c.backend for k, c in plans[0].items()}


def test_building_a_model_writes_no_bookkeeping_into_its_config():
    config = small_config()
    before = dict(vars(config))
    PretrainForCausalLM(config)
    assert {k: v for k, v in vars(config).items() if k not in before and not k.startswith("_attn")} == {}
    with pytest.raises(ValueError):  # an init that fails part-way ...
        PretrainForCausalLM._from_config(small_config(), attn_implementation="no_such_kernel")
    # ... leaves nothing behind: the next model's request is still the outermost one, and is recorded
    assert PretrainForCausalLM._from_config(config, attn_implementation="eager").config.attention_backend == "eager"
