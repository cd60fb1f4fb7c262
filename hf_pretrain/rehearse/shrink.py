"""The user's run made small: a tiny model of the same kind, and the script arguments that run it for a few steps.

The model (`tiny_config`): what decides how the run is wired keeps its value, what decides its cost
shrinks. Kept: the window pattern (one period of it, at least 2 layers, so the last layer is full as
in the real model), windows (shrunk to a quarter of the rehearsal's sequence, so they really cut),
the GQA ratio, MoE (experts capped at 4, top-k, every-k / fraction, capacity), tied embeddings, the
vocabulary size (the tokenizer's shape). Shrunk: width 64, head_dim 16, MLP 128, experts 64 wide.

The arguments (`script_arguments`): the user's, then overrides (argparse keeps the last value of a
repeated flag, so the user's own flags stay in the command, visibly overridden). The contract of a
rehearsable script, which examples/pretrain.py follows: transformers' `TrainingArguments` flags
(`--output_dir --max_steps --save_strategy --save_steps --logging_steps --per_device_train_batch_size
--gradient_accumulation_steps --resume_from_checkpoint PATH --report_to`), `--preset NAME_OR_DIR`
(a preset or a saved `PretrainConfig`) and `--seq_len`, unless the rehearsal runs with
`--keep-model`; it saves the final model with `trainer.save_model(args.output_dir)`.
"""

from __future__ import annotations

from pathlib import Path

from ..modeling.configuration import PretrainConfig
from ..presets import load_config

WIDTH, HEAD_DIM, MLP, EXPERT_MLP, MAX_EXPERTS = 64, 16, 128, 64, 4
CPU_KERNELS = ("sdpa", "eager")  # attention kernels a rehearsal runs as given


def check_sequence_parallel(tiny: PretrainConfig, seq_len: int, sp: int) -> None:
    """The rehearsal's model and sequence must admit its SP degree (DeepSpeed's and the loader's rules)."""
    heads, kv = tiny.num_attention_heads, tiny.num_key_value_heads
    if sp > 1 and (heads % sp or (kv % sp and sp % kv) or seq_len % sp):
        raise ValueError(
            f"sequence parallelism {sp}: the rehearsal's model ({heads} heads, {kv} KV) and --seq-len {seq_len} must "
            f"be divisible by it; pass an even --seq-len (the heads follow the launch's model)."
        )


def tensor_parallel_heads(tiny: PretrainConfig, tp: int) -> str:
    """How AutoTP of `tp` splits the rehearsal's heads, by DeepSpeed's own rule (`get_shard_size`: whole KV groups
    per rank, uneven ones allowed), e.g. "TP 2: heads 2 + 2, KV heads 1 + 1". Nothing is refused: uneven heads and
    fewer KV heads than ranks (a rank then holds no attention shard) train as one process does (measured,
    docs/distributed.md); the line says which case the rehearsal runs."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size

    heads, kv, dim = tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim
    meta = AutoTPMeta(num_kv_heads=kv, num_attention_heads=heads)
    q = [get_shard_size(heads * dim, tp, meta, "self_attn.q_proj", rank=r) // dim for r in range(tp)]
    k = [get_shard_size(kv * dim, tp, meta, "self_attn.k_proj", rank=r) // dim for r in range(tp)]
    line = f"TP {tp}: heads {' + '.join(map(str, q))}, KV heads {' + '.join(map(str, k))}"
    if 0 in k:
        return f"{line} (fewer KV heads than TP ranks: a rank holds no attention shard, as DeepSpeed warns)"
    return f"{line} (uneven, as AutoTP allows)" if len(set(k)) > 1 else line


def tiny_config(config: PretrainConfig, seq_len: int) -> PretrainConfig:
    """`config` at rehearsal size, keeping its layer pattern, windows, GQA, MoE and vocabulary."""
    fields = config.to_dict()
    for key in ("layer_types", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype"):
        fields.pop(key, None)
    pattern = config.window_pattern
    kv = min(config.num_key_value_heads or config.num_attention_heads, 2)
    group = max(1, config.num_attention_heads // (config.num_key_value_heads or config.num_attention_heads))
    fields.update(
        hidden_size=WIDTH,
        head_dim=HEAD_DIM,
        intermediate_size=MLP,
        num_attention_heads=kv * min(group, 4),
        num_key_value_heads=kv,
        num_hidden_layers=max(2, len(pattern), config.moe_every if config.num_experts else 1),
        max_position_embeddings=seq_len,
        attention_backend="auto",
        sliding_window=max(4, seq_len // 4) if "S" in pattern else config.sliding_window,
    )
    if config.num_experts:
        experts = min(config.num_experts, MAX_EXPERTS)
        fields.update(
            num_experts=experts,
            num_experts_per_tok=min(config.num_experts_per_tok, experts),
            moe_intermediate_size=EXPERT_MLP,
        )
    return PretrainConfig(**fields)


def describe(real: PretrainConfig, tiny: PretrainConfig) -> str:
    def shape(c: PretrainConfig) -> str:
        moe = f", MoE {c.num_experts} experts top-{c.num_experts_per_tok}" if c.num_experts else ""
        window = f" (window {c.sliding_window})" if "S" in c.window_pattern else ""
        return (
            f"{c.num_hidden_layers} x {c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV, "
            f"pattern {c.window_pattern!r}{window}{moe}, vocabulary {c.vocab_size}"
        )

    return f"{shape(real)} -> {shape(tiny)}"


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` (`--flag v` or `--flag=v`), or None."""
    value = None
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def drop_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        elif not word.startswith(flag + "="):
            out.append(word)
    return out


def write_tiny_model(user_args: list[str], seq_len: int, out: Path, sp: int = 1, tp: int = 1) -> tuple[Path, str]:
    """Save the shrunk model config to `out` (the script's --preset, default tiny); returns it and a description.
    `sp`: the rehearsal's SP degree, which the shrunk heads and sequence must admit; `tp`: its AutoTP degree, whose
    split of the heads the description says."""
    real = load_config(flag_value(user_args, "--preset") or "tiny")
    tiny = tiny_config(real, seq_len)
    check_sequence_parallel(tiny, seq_len, sp)
    tiny.save_pretrained(out)
    split = f"; {tensor_parallel_heads(tiny, tp)}" if tp > 1 else ""
    return out, describe(real, tiny) + split


def script_arguments(
    user_args: list[str],
    run_dir: Path,
    steps: int,
    save_steps: int,
    seq_len: int | None,
    model_dir: Path | None,
    data_cache: Path,
    dataset_path: str | None,
) -> tuple[list[str], list[str]]:
    """The user's arguments and the rehearsal's overrides; and notes on what was changed beyond size."""
    args, notes = drop_flag(user_args, "--resume_from_checkpoint"), []
    given = flag_value(args, "--dataset_path")
    if dataset_path:
        args = [*drop_flag(args, "--dataset_path"), "--dataset_path", dataset_path]
    elif given and not Path(given).exists():
        args = drop_flag(args, "--dataset_path")
        notes.append(f"--dataset_path {given} does not exist here: the example's embedded corpus instead")
    accumulation = min(int(flag_value(args, "--gradient_accumulation_steps") or 1), 2)
    overrides = [
        "--output_dir", str(run_dir),
        "--max_steps", str(steps),
        "--save_strategy", "steps",
        "--save_steps", str(save_steps),
        "--logging_steps", "1",
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", str(accumulation),
        "--eval_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    if model_dir is not None:
        overrides += ["--preset", str(model_dir), "--seq_len", str(seq_len), "--data_cache_dir", str(data_cache)]
    for flag, value, why in (
        ("--precision", "fp32", "precision recipes other than fp32 are GPU-only or ~100x slower on a CPU"),
        ("--bf16", "false", "fp32 on a CPU"),
        ("--dtype", "fp32", "fp32 on a CPU"),
        ("--torch_compile", "false", "compilation would dominate a few steps"),
        ("--attention_backend", "auto", "GPU kernels do not run here"),
    ):
        if flag == "--attention_backend" and flag_value(args, flag) in CPU_KERNELS:
            continue  # a kernel that runs here stays (SP checks the model runs the one it was given)
        if flag_value(args, flag) not in (None, value):
            overrides += [flag, value]
            notes.append(f"{flag} {flag_value(args, flag)} -> {value} ({why})")
    workers = flag_value(args, "--dataloader_num_workers")
    if workers and int(workers) > 1:
        overrides += ["--dataloader_num_workers", "1"]
    return args + overrides, notes
