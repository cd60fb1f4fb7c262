"""`optim="muon"`: which tensors Muon takes, the combined optimizer's state, its schedule, its refusals."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.training.loss_guard import LossGuardCallback, guard_optimizer
from hf_pretrain.training.optimizers import MuonWithAdamW, check_optimizer_supported, split_parameters
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_llama_hidden_projections_go_to_muon_the_rest_to_adamw():
    muon, adamw = split_parameters(PretrainForCausalLM(small_config()))
    assert len(muon) == 4 * len(HIDDEN) and all(n.split(".")[-2] in HIDDEN for n in muon)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(adamw)
    assert all(n.endswith("norm.weight") for n in adamw if n not in ("model.embed_tokens.weight", "lm_head.weight"))


def test_moe_router_and_stacked_experts_stay_on_adamw():
    model = PretrainForCausalLM(small_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    muon, adamw = split_parameters(model)
    assert not any(".mlp." in n for n in muon)  # routers (2-D) and 3-D experts
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= set(adamw)
    assert all(n.split(".")[-2] in HIDDEN[:4] for n in muon)


def test_tied_gpt2_split_by_shape_and_module():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    muon, adamw = split_parameters(model)
    assert "transformer.wte.weight" in adamw and "transformer.wpe.weight" in adamw  # lookups, tied head
    assert {n.rsplit(".", 2)[-2] for n in muon} == {"c_attn", "c_proj", "c_fc"}  # Conv1D weights
    assert all(n.endswith(".bias") or "ln_" in n for n in adamw if "wte" not in n and "wpe" not in n)


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = PretrainForCausalLM(small_config())
    params = dict(model.named_parameters())
    muon, adamw = split_parameters(model)
    optimizer = MuonWithAdamW(
        [{"params": [params[n] for n in muon]}],
        [{"params": [params[n] for n in adamw]}],
        {"lr": 0.02, "adjust_lr_fn": "original"},
        {"lr": 1e-3},
    )
    return model, optimizer


def train_steps(model, optimizer, steps, start=0):
    data = torch.tensor(dataset(n=8)["input_ids"])
    for i in range(start, start + steps):
        loss = model(input_ids=data, labels=data).loss * (1 + i % 3)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_state_dict_round_trips_and_training_continues_identically():
    model, optimizer = model_and_optimizer()
    train_steps(model, optimizer, 3)
    copy_model, copy_optimizer = model_and_optimizer(seed=1)  # different weights and fresh state
    copy_model.load_state_dict(model.state_dict())
    copy_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert copy_optimizer.muon.state is copy_optimizer.state and copy_optimizer.muon.param_groups[0]["use_muon"]
    train_steps(model, optimizer, 3, start=3)
    train_steps(copy_model, copy_optimizer, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy_model.parameters()))
    kinds = {frozenset(s) for s in copy_optimizer.state.values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}


def test_without_the_loaded_state_training_diverges():
    """The round trip above can fail: fresh momentum after the same weights gives other weights."""
    model, optimizer = model_and_optimizer()
    train_steps(model, optimizer, 3)
    copy_model, copy_optimizer = model_and_optimizer(seed=1)
    copy_model.load_state_dict(model.state_dict())
    train_steps(model, optimizer, 1, start=3)
    train_steps(copy_model, copy_optimizer, 1, start=3)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), copy_model.parameters()))


def test_loss_guard_skips_and_scales_both_sides():
    model, optimizer = model_and_optimizer()
    guard = LossGuardCallback()
    guard_optimizer(optimizer, guard)
    seen = []
    inner_step = optimizer.muon.step
    optimizer.muon.step = lambda: (seen.append(optimizer.muon.param_groups[0]["lr"]), inner_step())
    before = [p.detach().clone() for p in model.parameters()]
    guard.skip_next_update = True
    train_steps(model, optimizer, 1)
    assert seen == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    guard.lr_scale = 0.5
    train_steps(model, optimizer, 1)
    assert seen == [0.01] and optimizer.muon.param_groups[0]["lr"] == 0.02  # scaled for the step, then restored


def trainer_for(tmp_path, model=None, **overrides):
    settings = dict(max_steps=4, per_device_train_batch_size=4, measure_peak_tflops=False)
    args = quick_args(tmp_path, **{**settings, **overrides})
    return PretrainTrainer(model=model or PretrainForCausalLM(small_config()), args=args, train_dataset=dataset())


def test_the_schedule_drives_both_groups_from_their_own_peaks(tmp_path, capsys):
    trainer = trainer_for(tmp_path, optim="muon", muon_lr=0.02, learning_rate=1e-3, warmup_steps=2)
    trainer.train()
    assert "optimizer: Muon for 28 hidden matrices" in capsys.readouterr().out
    groups = trainer.optimizer.param_groups
    assert [g["use_muon"] for g in groups] == [False, False, True]
    assert [g["initial_lr"] for g in groups] == [1e-3, 1e-3, 0.02]
    factor = groups[0]["lr"] / 1e-3
    assert 0 < factor < 1 and groups[2]["lr"] == pytest.approx(0.02 * factor)  # one schedule, two peaks
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0  # Trainer's decay split
    assert groups[2]["weight_decay"] == 0.1 and groups[2]["adjust_lr_fn"] == "match_rms_adamw"


def test_default_stays_the_trainers_adamw_for_any_model(tmp_path):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    ours = trainer_for(tmp_path / "a", model=gpt2)
    plain = Trainer(model=gpt2, args=ours.args, train_dataset=dataset())
    assert ours.args.pretrain_optimizer is None
    a, b = ours.create_optimizer(), plain.create_optimizer()
    assert type(a) is type(b) and a.defaults == b.defaults
    assert [[id(p) for p in g["params"]] for g in a.param_groups] == [
        [id(p) for p in g["params"]] for g in b.param_groups
    ]


def test_muon_trains_a_gpt2_under_pretrain_trainer(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    trainer = trainer_for(tmp_path, model=gpt2, optim="muon", max_steps=8, learning_rate=3e-3)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert isinstance(trainer.optimizer.optimizer, MuonWithAdamW) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim": "mu0n"}, "optim='mu0n' is invalid; use 'muon'"),
        ({"optim": "muon", "muon_adjust_lr": "rms"}, "muon_adjust_lr='rms' is invalid"),
        ({"optim": "muon", "muon_momentum": 1.5}, "muon_momentum=1.5 is invalid"),
        ({"optim": "muon", "muon_lr": 0.0}, "muon_lr=0.0 is invalid"),
        ({"optim": "muon", "pretrain_extras": False}, "keep pretrain_extras=True"),
    ],
)
def test_bad_settings_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        quick_args(tmp_path, **overrides)
    assert "\n" not in str(error.value)


REFUSAL = """
from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import quick_args, small_config
extra = {"deepspeed": "ds_configs/zero3.json"} if "{kind}" == "deepspeed" else {"fsdp": True, "fsdp_config": {"version": 2}}
args = quick_args("{out}", max_steps=1, optim="muon", measure_peak_tflops=False, telemetry=False, **extra)
PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args)
"""


NO_CPU_FSDP = "accelerate 1.15 enables FSDP only for GPU-like devices (not MULTI_CPU): the logic test below covers CPU"


@pytest.mark.exhaustive  # a DeepSpeed engine under torchrun; make test: the refusal's logic test below
@pytest.mark.parametrize(
    "kind",
    ["deepspeed", pytest.param("fsdp", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CPU_FSDP))],
)
def test_sharded_runs_refuse_muon_naming_the_field_and_the_fix(tmp_path, kind):
    """A real DeepSpeed ZeRO-3 / FSDP2 trainer (one process under torchrun: FSDP needs a process group)."""
    script = tmp_path / "refuse.py"
    script.write_text(REFUSAL.replace("{kind}", kind).replace("{out}", str(tmp_path)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    sharding = "DeepSpeed" if kind == "deepspeed" else "FSDP"
    expected = f"ValueError: optim='muon' needs each hidden weight whole on every rank, and {sharding} shards"
    assert proc.returncode != 0 and expected in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "train with DDP (no deepspeed/fsdp), or use optim='adamw_torch'" in proc.stderr


def test_an_fsdp_trainer_refuses_muon(tmp_path):
    """`Trainer.is_fsdp_enabled` (set from accelerate's FSDP plugin) is what the refusal reads."""
    trainer = trainer_for(tmp_path, optim="muon")
    trainer.is_fsdp_enabled = True
    with pytest.raises(ValueError, match="optim='muon' needs each hidden weight whole on every rank, and FSDP shards"):
        check_optimizer_supported(trainer)
    trainer.args.pretrain_optimizer = None  # AdamW under FSDP: nothing to refuse
    check_optimizer_supported(trainer)


def test_an_optimizer_passed_beside_optim_muon_is_refused_not_ignored(tmp_path):
    model = PretrainForCausalLM(small_config())
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    args = quick_args(tmp_path, max_steps=1, optim="muon", measure_peak_tflops=False)
    with pytest.raises(ValueError, match=r"optim='muon' and an optimizer passed in optimizers=\(...\) both"):
        PretrainTrainer(model=model, args=args, train_dataset=dataset(), optimizers=(mine, None))
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset(), optimizers=(None, None))
    assert isinstance(trainer.create_optimizer(), MuonWithAdamW)
