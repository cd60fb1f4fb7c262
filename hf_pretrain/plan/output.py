"""What a plan gives back: the screen table, `plan.json`, and the files that launch it.

`write_plan(plan, out_dir)` writes into `out_dir`:
- `plan.json`: every number of the plan, with its source (`plan_dict`);
- `model/config.json`: the model as a `PretrainConfig` (`save_pretrained`), which `examples/pretrain.py
  --preset out_dir/model` trains;
- `accelerate_config.yaml`: the shipped config of the chosen strategy (examples/accelerate_configs/) with
  the plan's processes and machines (and, over several nodes, `two_nodes.yaml`'s rendezvous keys), pointing
  at the shipped DeepSpeed preset (ds_configs/) for ZeRO-2/3: the settings keep one home, the repository's;
  with sequence parallelism, the `parallelism_config` keys of `cpu_2proc_sp.yaml` (the tested SP launch) with
  the plan's degree; with AutoTP, the plan's own DeepSpeed JSON (below) instead of the preset;
- `deepspeed_autotp.json` (AutoTP only): `ds_configs/zero1_autotp.json` with the plan's `autotp_size` (the
  preset stays as shipped);
- `launch.sh`: the exact `accelerate launch examples/pretrain.py ...` command (run it on every node with
  MACHINE_RANK set when there are several), with restarts allowed (`--max_restarts`, a rendezvous store per
  attempt) and `--resume_from_checkpoint auto`, so a failed run resumes by itself; with SP, documents packed
  GPT-style and SDPA attention (what SP runs: `training/sequence_parallel.py`).
The launch files are for a checkout of the repository (run from its root), where the example and the
presets live.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from ..distributed.memory import GiB
from ..training.recovery.attempts import RESTARTABLE
from .hardware import LINK_EFFICIENCY
from .planner import Plan, network_words
from .resilience import SOURCE as CHECKPOINT_SOURCE

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "examples" / "accelerate_configs"
SOURCES = {
    "tokens_per_parameter": "Hoffmann et al. 2022, arXiv 2203.15556 (Chinchilla): ~20 tokens per parameter",
    "batch_and_lr": "DeepSeek-AI 2024, arXiv 2401.02954, section 3.1: B_opt = 0.2920 C^0.3271 tokens, "
    "eta_opt = 0.3118 C^-0.1250, C = non-embedding FLOPs per token x tokens",
    "repeated_data": "Muennighoff et al. 2023, arXiv 2305.16264: repeated data holds its value up to ~4 epochs",
    "memory": "hf_pretrain.distributed.memory.estimate_memory (docs/memory.md)",
    "flops": "hf_pretrain.modeling.accounting.flops_per_token (6 x matmul weights + attention)",
    "peak": "hf_pretrain.chips.CHIPS",
    "checkpoint_interval": CHECKPOINT_SOURCE,
}
SP_TEMPLATE = "cpu_2proc_sp.yaml"  # the SP launch the tests run: its parallelism_config keys
SP_ARGUMENTS = ["--separate_documents", "false", "--attention_backend", "sdpa"]  # what Ulysses SP runs
MAX_RESTARTS = 3  # launch.sh: the launcher restarts a failed run this many times (each resumes by itself)
SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "window_pattern",
    "sliding_window",
    "tie_word_embeddings",
)


def deepspeed_json(plan: Plan) -> dict:
    """The strategy's DeepSpeed preset, with the plan's AutoTP degree."""
    config = json.loads((ROOT / plan.strategy.deepspeed_config).read_text())
    if plan.tp > 1:
        config["tensor_parallel"] = {**config.get("tensor_parallel", {}), "autotp_size": plan.tp}
    return config


def accelerate_config(plan: Plan, deepspeed_file: str | None = None) -> dict:
    """The shipped accelerate config of the plan's strategy, set to its processes, machines and presets
    (`deepspeed_file`: the plan's own DeepSpeed JSON in place of the preset, for AutoTP)."""
    hw, strategy = plan.hardware, plan.strategy
    path = TEMPLATES / strategy.template
    if not path.exists():
        raise ValueError(f"{path} is missing: hf-pretrain plan writes launch files for a checkout of the repository.")
    config = yaml.safe_load(path.read_text())
    config.update(num_machines=hw.nodes, num_processes=hw.world, machine_rank=0)
    if hw.nodes > 1:
        nodes = yaml.safe_load((TEMPLATES / "two_nodes.yaml").read_text())
        config.update({key: nodes[key] for key in ("main_process_ip", "main_process_port", "same_network")})
    if strategy.deepspeed_config:
        config["deepspeed_config"]["deepspeed_config_file"] = deepspeed_file or strategy.deepspeed_config
        config["deepspeed_config"]["zero3_init_flag"] = strategy.zero == 3
    if strategy.name == "fsdp2":
        config["fsdp_config"]["fsdp_activation_checkpointing"] = plan.checkpointing
    if plan.sp > 1:
        keys = yaml.safe_load((TEMPLATES / SP_TEMPLATE).read_text())["parallelism_config"]
        config["parallelism_config"] = {**keys, "parallelism_config_sp_size": plan.sp}
    config["rdzv_backend"] = "c10d"  # restarts: a new rendezvous each attempt (with launch.sh's environment)
    if hw.nodes > 1:
        config["same_network"] = False  # c10d's endpoint: main_process_ip:main_process_port
    return config


def save_steps(plan: Plan) -> int:
    """A checkpoint every Young/Daly interval of predicted wall-clock (at least every step, at most once per run)."""
    return max(1, min(plan.steps, round(plan.checkpoints.interval_s / plan.step_seconds)))


def launch_command(plan: Plan, out_dir: str, dataset: str, run_dir: str) -> list[str]:
    """argv of the launch (without --machine_rank, which launch.sh adds per node)."""
    args = ["accelerate", "launch", "--config_file", f"{out_dir}/accelerate_config.yaml"]
    args += ["--max_restarts", str(MAX_RESTARTS), "examples/pretrain.py"]
    args += ["--preset", f"{out_dir}/model", "--dataset_path", dataset, "--output_dir", run_dir]
    args += ["--seq_len", str(plan.seq_len), "--vocab_size", str(plan.config.vocab_size)]
    args += ["--per_device_train_batch_size", str(plan.micro_batch), "--per_device_eval_batch_size"]
    args += [str(plan.micro_batch), "--gradient_accumulation_steps", str(plan.grad_accum)]
    args += ["--max_steps", str(plan.steps), "--precision", plan.hardware.precision]
    args += ["--learning_rate", f"{plan.peak_lr:.3g}", "--lr_scheduler_type", plan.schedule]
    args += ["--lr_scheduler_kwargs", json.dumps(plan.schedule_kwargs, separators=(",", ":"))]
    args += ["--save_strategy", "steps", "--save_steps", str(save_steps(plan)), "--logging_steps", "10"]
    args += ["--resume_from_checkpoint", "auto"]
    if plan.checkpointing and plan.strategy.name != "fsdp2":  # FSDP2 checkpoints through its accelerate config
        args.append("--gradient_checkpointing")
    if plan.sp > 1:
        args += SP_ARGUMENTS
    return args


def _network_state(plan: Plan) -> str:
    """plan.json's word on the network between nodes: not crossed, unavailable (not zero), or priced."""
    if plan.hardware.nodes == 1:
        return "one node: nothing crosses the network"
    if plan.network_share is None:
        return (
            "unavailable, not priced: the data-parallel traffic across nodes is not in the prediction and AutoTP / SP "
            "are not weighed against ZeRO-3 across nodes (--network-gbps)"
        )
    return "priced: the data-parallel traffic across nodes the compute does not hide is in the prediction"


def plan_dict(plan: Plan, command: list[str] | None = None) -> dict:
    hw, mem, traffic = plan.hardware, plan.memory, plan.network_traffic
    return {
        "hardware": {**vars(hw), "world": hw.world},
        "budget": plan.budget,
        "model": {
            "parameters": plan.parameters,
            "flops_per_token": plan.flops_per_token,
            "config": {name: getattr(plan.config, name) for name in SHAPE_FIELDS},
        },
        "tokens": {
            "train": plan.tokens,
            "per_parameter": plan.tokens / plan.parameters,
            "target_per_parameter": plan.tokens_per_param_target,
            "unique_data": plan.data_tokens,
            "epochs": plan.epochs,
        },
        "batch": {
            "global_tokens": plan.global_batch_tokens,
            "gpus": hw.world,
            "micro_batch": plan.micro_batch,
            "gradient_accumulation": plan.grad_accum,
            "seq_len": plan.seq_len,
            "steps": plan.steps,
            "deepseek_b_opt_tokens": plan.batch_opt_tokens,
            "deepseek_compute": plan.deepseek_compute,
        },
        "parallelism": {
            "strategy": plan.strategy.name,
            "zero": plan.strategy.zero,
            "deepspeed_config": plan.strategy.deepspeed_config,  # the preset; with AutoTP, the plan's copy below
            "deepspeed_config_written": "deepspeed_autotp.json" if plan.tp > 1 else None,
            "accelerate_template": f"examples/accelerate_configs/{plan.strategy.template}",
            "activation_checkpointing": plan.checkpointing,
            "precision": hw.precision,
            "sp_size": plan.sp,
            "data_parallel_groups": plan.data_parallel,
            "sp_reason": plan.sp_reason,
            "tp_size": plan.tp,
            "tp_reason": plan.tp_reason,
            "collective": plan.collective,
            "collective_bytes_per_gpu_step": plan.collective_bytes,
            "collective_seconds_per_step": plan.collective_seconds,
            "collective_priced": plan.collective is not None and plan.collective_seconds is not None,
            "link_gbps_each_way": hw.link_gbps,
            "link_source": hw.link_source,
            "link_efficiency": LINK_EFFICIENCY,
            "inter_node_network": _network_state(plan),
            "network_gbps_each_way_per_gpu": hw.network_gbps,
            "network_source": hw.network_source,
            "network_bytes_per_gpu_micro_step": traffic.micro_step if traffic else 0.0,
            "network_bytes_per_gpu_step": traffic.step if traffic else 0.0,
            "network_seconds_per_step": plan.network_seconds,
            "network_reason": plan.network_reason,
        },
        "memory": {**mem.to_dict(), "usable_bytes": plan.usable_bytes},
        "schedule": {"type": plan.schedule, "peak_lr": plan.peak_lr, "lr_scheduler_kwargs": plan.schedule_kwargs},
        "prediction": {
            "tokens_per_second": plan.tokens_per_second,
            "step_seconds": plan.step_seconds,
            "hours": plan.hours,
            "gpu_hours": plan.gpu_hours,
            "model_flops": plan.model_flops,
        },
        "checkpoints": {
            "save_steps": save_steps(plan),
            "interval_s": plan.checkpoints.interval_s,
            "stall_s": plan.checkpoints.stall_s,
            "stall_source": plan.checkpoints.stall_source,
            "mtbf_hours": plan.checkpoints.mtbf_hours,
            "mtbf_source": plan.checkpoints.mtbf_source,
            "expected_lost_share": plan.checkpoints.lost_share,
            "max_restarts": MAX_RESTARTS,
        },
        "warnings": plan.warnings,
        "sources": SOURCES,
        "command": shlex.join(command) if command else None,
    }


def _si(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{prefix}{unit}"
    return f"{value:.3g}{unit}"


def _ranks(plan: Plan) -> str:
    """Who trains different rows: the GPUs, or with SP (TP) the data-parallel groups of `sp` (`tp`) GPUs."""
    world = plan.hardware.world
    if plan.sp > 1 or plan.tp > 1:
        degree = f"SP {plan.sp}" if plan.sp > 1 else f"TP {plan.tp}"
        return f"{world} GPUs / {degree} = {plan.data_parallel} group{'s' if plan.data_parallel > 1 else ''}"
    return f"{world} GPU{'s' if world > 1 else ''}"


def _collective(plan: Plan) -> str:
    """SP's all-to-all (AutoTP's all-reduce) per step: its volume and, where the link is known, its time (in the
    step above)."""
    sent = f"{plan.collective} {plan.collective_bytes / GiB:,.1f} GiB sent per GPU per step"
    if plan.collective_seconds is None:
        return f"{sent}, not priced ({plan.hardware.link_source}): not in the step time"
    rate = plan.hardware.link_gbps * LINK_EFFICIENCY
    return f"{sent} at {rate:g} GB/s = {plan.collective_seconds:.2f} s of the step"


def _network_link(hw) -> list[tuple[str, str]]:
    """The hardware row of the network between nodes: only over several nodes, or when given."""
    if hw.nodes == 1 and hw.network_gbps is None:
        return []
    if hw.nodes == 1:
        return [("", f"network {hw.network_gbps:g} GB/s each way per GPU (--network-gbps): not crossed on one node")]
    if hw.network_gbps is None:
        return [("", f"network unavailable between nodes ({hw.network_source})")]
    return [("", f"network {hw.network_gbps:g} GB/s each way per GPU between nodes ({hw.network_source})")]


def _network(plan: Plan) -> list[tuple[str, str]]:
    """The prediction's row of the data-parallel traffic across nodes, where priced."""
    seconds = plan.network_seconds
    if plan.hardware.nodes == 1 or seconds is None:
        return []
    words = network_words(plan.config, plan.seq_len, plan.hardware, plan.fit, plan.sp, plan.tp, plan.grad_accum)
    return [("", f"{plan.strategy.label} across nodes, {words}; +{seconds:.2f} s a step")]


def table(plan: Plan) -> str:
    hw, c, mem = plan.hardware, plan.config, plan.memory
    nodes = f"{hw.nodes} nodes x {hw.gpus_per_node}" if hw.nodes > 1 else f"{hw.gpus_per_node}"
    budget = {"hours": " h", "tokens": " tokens", "flops": " FLOPs"}[plan.budget["kind"]]
    windows = f"{c.window_pattern} (window {c.sliding_window})" if "S" in c.window_pattern else "none"
    epochs = f"{plan.epochs:.2f} epochs over {_si(plan.data_tokens)} unique" if plan.data_tokens else "data unknown"
    schedule = plan.schedule_kwargs
    shape = "cosine to 10 %" if plan.schedule == "cosine_restarts" else "WSD, 1-sqrt decay over the last 20 %"
    rows = [
        ("hardware", f"{nodes} x {hw.device} = {hw.world} GPU{'s' if hw.world > 1 else ''}, {hw.precision}"),
        ("", f"peak {hw.peak_tflops:g} TFLOP/s per GPU ({hw.peak_source}); memory {hw.memory_bytes / GiB:.1f} GiB"),
        ("", f"MFU {hw.mfu:.3f} ({hw.mfu_source})"),
        ("", f"link {f'{hw.link_gbps:g} GB/s each way per GPU' if hw.link_gbps else 'unavailable'} ({hw.link_source})"),
        *_network_link(hw),
        (
            "budget",
            f"{plan.budget['value']:.4g}{budget}"
            + (f" = {plan.budget['flops']:.3g} model FLOPs" if plan.budget["flops"] else ""),
        ),
        (
            "model",
            f"{plan.parameters / 1e9:.3f}B parameters: {c.num_hidden_layers} layers x {c.hidden_size}, "
            f"{c.num_attention_heads} heads ({c.num_key_value_heads} KV, head_dim {c.head_dim}), SwiGLU "
            f"{c.intermediate_size}, vocabulary {c.vocab_size}, windows {windows}",
        ),
        ("", f"{plan.flops_per_token:.3g} FLOPs per token at sequence {plan.seq_len}"),
        (
            "tokens",
            f"{_si(plan.tokens)} = {plan.tokens / plan.parameters:.1f} per parameter "
            f"(target {plan.tokens_per_param_target:g}); {epochs}",
        ),
        (
            "batch",
            f"{plan.global_batch_tokens:,} tokens = {_ranks(plan)} x micro-batch {plan.micro_batch} x accumulation "
            f"{plan.grad_accum} x {plan.seq_len} (DeepSeek B_opt {_si(plan.batch_opt_tokens)}); {plan.steps:,} steps",
        ),
        (
            "memory",
            f"{plan.strategy.label}{f' + Ulysses SP {plan.sp}' if plan.sp > 1 else ''}"
            f"{f' + AutoTP {plan.tp}' if plan.tp > 1 else ''}, activation checkpointing "
            f"{'on' if plan.checkpointing else 'off'}: {mem.total / GiB:.1f} GiB per GPU of "
            f"{plan.usable_bytes / GiB:.1f} usable (estimator)",
        ),
        *([("sequence", plan.sp_reason)] if plan.sp_reason else []),
        *([("tensor", plan.tp_reason)] if plan.tp_reason else []),
        *([("network", plan.network_reason)] if plan.network_reason else []),
        (
            "schedule",
            f"{plan.schedule}: peak {plan.peak_lr:.3g} (DeepSeek eta_opt), warmup {_si(schedule['warmup_tokens'])} "
            f"tokens, {shape}, at {_si(schedule['total_tokens'])} tokens",
        ),
        (
            "predicted",
            f"{plan.step_seconds:.2f} s/step, {_si(plan.tokens_per_second)} tokens/s, wall-clock {plan.hours:.1f} h, "
            f"{plan.gpu_hours:,.0f} GPU-hours",
        ),
        *([("", _collective(plan))] if plan.collective else []),
        *_network(plan),
    ]
    from ..evaluation.downstream.budget import plan_row

    ckpt = plan.checkpoints
    rows += [
        ("downstream", plan_row(plan)),
        (
            "checkpoint",
            f"every {save_steps(plan):,} steps ({ckpt.interval_s / 3600:.2f} h): Young/Daly sqrt(2 x {ckpt.stall_s:.2g} s "
            f"stall x {ckpt.mtbf_hours:,.0f} h between failures), expected loss {ckpt.lost_share:.2%} + relaunches",
        ),
        ("", f"stall: {ckpt.stall_source}; failures: {ckpt.mtbf_source}"),
        (
            "",
            f"restarts: up to {MAX_RESTARTS}, each resuming from the newest checkpoint (--resume_from_checkpoint auto)",
        ),
    ]
    rows += [("warning", text) for text in plan.warnings]
    return "\n".join(f"{name:<10} {text}" for name, text in rows)


def write_plan(
    plan: Plan, out_dir: str | Path = "plan", dataset: str = "DATA_PATH", run_dir: str = "runs/plan"
) -> dict[str, Path]:
    """Write plan.json, model/config.json, accelerate_config.yaml and launch.sh (and deepspeed_autotp.json with
    AutoTP); return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = launch_command(plan, str(out_dir), dataset, run_dir)
    files = {
        "plan": out / "plan.json",
        "model": out / "model" / "config.json",
        "accelerate_config": out / "accelerate_config.yaml",
        "launch": out / "launch.sh",
    }
    deepspeed_file = None
    if plan.tp > 1:  # the plan's own JSON, beside the rest: the preset stays as shipped
        files["deepspeed"] = out / "deepspeed_autotp.json"
        files["deepspeed"].write_text(json.dumps(deepspeed_json(plan), indent=2) + "\n")
        deepspeed_file = f"{out_dir}/deepspeed_autotp.json"
    head = f"# hf-pretrain plan: from examples/accelerate_configs/{plan.strategy.template}\n"
    config = accelerate_config(plan, deepspeed_file)
    files["accelerate_config"].write_text(head + yaml.safe_dump(config, sort_keys=False))
    plan.config.save_pretrained(out / "model")
    rank = ' --machine_rank "${MACHINE_RANK:-0}"' if plan.hardware.nodes > 1 else ""
    script = shlex.join(command[:4]) + rank + " " + shlex.join(command[4:])
    restartable = "".join(f"export {name}={value}\n" for name, value in RESTARTABLE.items())
    files["launch"].write_text(
        "#!/bin/sh\n# Written by hf-pretrain plan; run from the repository root"
        + (" on every node, MACHINE_RANK=0 on the main one" if rank else "")
        + ".\nset -e\n# a new rendezvous store for each restart (pytorch/pytorch#135712)\n"
        + f"{restartable}{script}\n"
    )
    files["launch"].chmod(0o755)
    files["plan"].write_text(json.dumps(plan_dict(plan, command), indent=2) + "\n")
    return files
