"""Pretrain a Llama-style model from scratch: `accelerate launch examples/pretrain.py`.

With no arguments it runs the embedded default on a CPU in minutes: a corpus of English text that
ships with Python through the data chain of `hf-pretrain data prepare` (`run_pipeline`: read,
clean, dedup, held-out split by document, a byte-level BPE tokenizer trained on it, packing into
256-token blocks; each step cached and reused), the `tiny` preset in fp32, evaluation on the
held-out split against the corpus's unigram entropy, and greedy samples from fixed prompts. Every
knob is a flag (`--help`); the same script trains a bigger preset in bf16 on a GPU:

    accelerate launch examples/pretrain.py --preset gpt2-124m --seq_len 1024 \\
        --dataset_path my_corpus/ --vocab_size 50304 --max_steps 20000

and runs as two real CPU ranks (gloo) with `accelerate launch --multi_gpu --num_processes 2`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import hf_pretrain  # noqa: F401  (first: it quiets the import noise of torchao, which transformers imports) # isort: skip
import numpy as np
import torch
from transformers import HfArgumentParser, PreTrainedTokenizerBase, set_seed

from hf_pretrain import PretrainConfig, PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.data import PackedDocumentCollator, write_embedded_corpus
from hf_pretrain.data.blocks import BlockStats
from hf_pretrain.data.chain import reused_stages, run_pipeline
from hf_pretrain.data.mixture import MixtureConfig, MixtureDataset
from hf_pretrain.data.packing import check_seq_len
from hf_pretrain.data.pipeline_config import PipelineConfig
from hf_pretrain.data.prepared import load_packed, tokenizer_path
from hf_pretrain.data.read import list_files
from hf_pretrain.data.split import check_fraction
from hf_pretrain.data.tokenizer import check_vocab_size
from hf_pretrain.modeling.attention import Environment, plan_attention
from hf_pretrain.precision import high_precision
from hf_pretrain.preflight.memory import MemoryPreflightError, RunShape, check_memory, enforce_memory_policy
from hf_pretrain.presets import PRESETS, load_config
from hf_pretrain.training.arguments import check_mixture_flags, mixture_tokenizer
from hf_pretrain.training.fsdp import sharding_requested
from hf_pretrain.training.resume.check import CheckpointError
from hf_pretrain.training.resume.checkpointing import check_resume, resume_target

PROMPTS = ("The for statement", "A class definition", "If 5x + 3 = 13, then x is")

# Defaults of the embedded run; any of them can be overridden on the command line.
EXAMPLE_DEFAULTS = dict(
    output_dir="runs/tiny",
    max_steps=300,
    per_device_train_batch_size=16,
    per_device_eval_batch_size=16,
    learning_rate=3e-3,
    warmup_steps=30,
    lr_scheduler_type="cosine",
    weight_decay=0.1,
    adam_beta2=0.95,
    max_grad_norm=1.0,
    logging_steps=25,
    save_strategy="no",
    eval_strategy="no",
    prediction_loss_only=True,
    report_to="none",
    seed=42,
    dataloader_num_workers=0,
)


@dataclass
class ModelArguments:
    preset: str = field(
        default="tiny",
        metadata={
            "help": f"Size preset, one of {sorted(PRESETS)}, or a saved config (directory or config.json), "
            "e.g. the model/ folder `hf-pretrain plan` writes."
        },
    )
    window_pattern: str | None = field(default=None, metadata={"help": "Override the preset's pattern, e.g. SSSL."})
    sliding_window: int | None = field(default=None, metadata={"help": "Window of S layers, in tokens."})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto (fastest kernel per layer type), flash_attention_3, flash_attention_2, flex_attention, sdpa, eager."
        },
    )
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on a GPU that has it, else fp32), fp32 or bf16."})


@dataclass
class DataArguments:
    dataset_path: str | None = field(
        default=None,
        metadata={
            "help": "Your data: jsonl/json/txt/parquet/arrow file(s) or a save_to_disk folder. Default: embedded corpus."
        },
    )
    mixture: str | None = field(
        default=None,
        metadata={
            "help": "A weighted mixture of prepared sources (a JSON file, docs/data.md#weighted-mixtures) instead of "
            "--dataset_path: trained in its order, its realised shares logged."
        },
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    heldout_fraction: float = field(
        default=0.05, metadata={"help": "Fraction of documents held out (when no split exists)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "An existing tokenizer; default: train a BPE."}
    )
    vocab_size: int | None = field(
        default=None, metadata={"help": "BPE vocabulary size to train (default: the preset's)."}
    )
    seq_len: int = field(default=256, metadata={"help": "Tokens per packed block."})
    data_cache_dir: str | None = field(
        default=None, metadata={"help": "Where corpus, tokenizer and packed blocks are cached."}
    )
    num_proc: int | None = field(default=None, metadata={"help": "Worker processes of every data step."})
    separate_documents: bool = field(
        default=True, metadata={"help": "Keep attention and positions within each packed document (False: GPT-style)."}
    )
    clean: bool = field(default=True, metadata={"help": "Clean and quality-filter documents (hf_pretrain.data.clean)."})
    dedup: bool = field(
        default=True, metadata={"help": "Remove exact and near-duplicate documents (before the held-out split)."}
    )


def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, DataArguments, PretrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    parser.set_defaults(**{**EXAMPLE_DEFAULTS, **implied_defaults(argv)})
    return parser.parse_args_into_dataclasses(args=argv)


def flag_value(flag: str, argv: list[str]) -> str | None:
    """The value given to `flag` on the command line (`--flag value` or `--flag=value`), None when not given."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def implied_defaults(argv: list[str]) -> dict:
    """The example saves nothing by default (save_strategy "no"): --save_steps given alone asks for saves at those
    steps, as with plain `Trainer` (whose save_strategy defaults to "steps"); beside --save_strategy no it is
    refused, since one of the two would be ignored (and `--resume_from_checkpoint auto` would restart from 0)."""
    if flag_value("--save_steps", argv) is None:
        return {}
    strategy = flag_value("--save_strategy", argv)
    if strategy == "no":
        raise ValueError(
            "--save_steps is given but --save_strategy is no: drop --save_strategy no to save every N steps."
        )
    return {} if strategy else {"save_strategy": "steps"}


def resolve_dtype(model_args: ModelArguments, args: PretrainingArguments) -> tuple[str, PretrainingArguments]:
    """The compute dtype, and the arguments rebuilt for it (so accelerate's mixed precision follows)."""
    if model_args.dtype not in ("auto", "fp32", "bf16"):
        raise ValueError(f"--dtype={model_args.dtype!r} is invalid; use auto, fp32 or bf16.")
    dtype = model_args.dtype
    if args.precision is not None:  # a precision recipe decides the autocast dtype itself
        return ("bf16" if args.bf16 else "fp32"), args
    if dtype == "auto":
        gpu_bf16 = not args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        dtype = "bf16" if args.bf16 or gpu_bf16 else "fp32"
    if args.bf16 != (dtype == "bf16"):
        args = dataclasses.replace(args, bf16=dtype == "bf16")  # re-runs __post_init__: sets mixed_precision
    return dtype, args


def unigram_entropy(blocks) -> float:
    """Entropy in nats per token of the unigram distribution of the packed training tokens (of a mixture: its
    first 10,000 rows in training order)."""
    rows = (
        blocks["input_ids"]
        if hasattr(blocks, "column_names")
        else [blocks[i]["input_ids"] for i in range(min(len(blocks), 10_000))]
    )
    counts = np.bincount(np.concatenate([np.asarray(ids) for ids in rows]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def pipeline_config(data_args: DataArguments, source: str, cache: Path, vocab_size: int) -> PipelineConfig:
    """The data chain of this job: the flags as the sections of `hf-pretrain data prepare`."""
    tokenizer = data_args.tokenizer_name_or_path
    return PipelineConfig(
        input=source,
        output_dir=str(cache / "prepared"),
        text_column=data_args.text_column,
        num_proc=data_args.num_proc,
        heldout_fraction=data_args.heldout_fraction,
        clean={} if data_args.clean else None,
        dedup={"verbose": False} if data_args.dedup else None,
        tokenizer={"path": tokenizer} if tokenizer else {"vocab_size": data_args.vocab_size or vocab_size},
        pack={"seq_len": data_args.seq_len, "mode": "concat"},
    )


def prepare_data(data_args: DataArguments, args: PretrainingArguments, vocab_size: int):
    """Tokenizer, packed train blocks and packed held-out blocks (None when too few to fill one)."""
    from transformers import AutoTokenizer

    if data_args.mixture:
        return prepare_mixture(data_args, args)
    cache = Path(data_args.data_cache_dir or Path(args.output_dir) / "data")
    # The whole world's main process first, not each node's: nodes that share a filesystem (and the two "nodes" of
    # a rehearsal on one machine) would otherwise write the same cache at once; the others then reuse it, or
    # prepare their own copy where the filesystem is not shared.
    with args.main_process_first(local=False, desc="corpus, tokenizer and packing"):
        source = data_args.dataset_path
        if not source:
            source = str(write_embedded_corpus(cache / "corpus", data_args.heldout_fraction)["train"].parent)
        config = pipeline_config(data_args, source, cache, vocab_size)
        stats = run_pipeline(config, verbose=False)
        packed = load_packed(config.output_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(config.output_dir)))
    if args.process_index == 0:
        source = data_args.dataset_path or f"embedded corpus ({source})"
        report_data(stats, reused_stages(config.output_dir), source, len(tokenizer))
    return tokenizer, packed["train"], packed.get("heldout")


def prepare_mixture(data_args: DataArguments, args: PretrainingArguments):
    """The tokenizer, the mixture's training order and the sources' held-out rows (None when none has any)."""
    from datasets import concatenate_datasets
    from transformers import AutoTokenizer

    config = MixtureConfig.from_file(data_args.mixture)
    tokenizer = AutoTokenizer.from_pretrained(mixture_tokenizer(config, data_args.tokenizer_name_or_path))
    train = MixtureDataset(config)
    longest = max(max(len(ids) for ids in source["input_ids"]) for source in train.sources)
    if longest > data_args.seq_len:
        raise ValueError(
            f"--mixture: its sources hold rows of {longest} tokens, above --seq_len {data_args.seq_len}; "
            f"give --seq_len {longest} (or pack the sources to --seq_len)."
        )
    heldout = [
        load_packed(s["path"])["heldout"].select_columns(["input_ids"])
        for s in config.sources.values()
        if any(Path(s["path"]).glob("*-pack")) and "heldout" in load_packed(s["path"])
    ]
    if args.process_index == 0:
        print(f"[data] {train.describe()}")
        print(f"[tokenizer] {len(tokenizer)} tokens, shared by the mixture's sources")
    return tokenizer, train, concatenate_datasets(heldout) if heldout else None


def report_data(blocks: list[BlockStats], reused: list[str], source: str, vocab: int) -> None:
    """The chain's counters, one line a step: documents, drops, the tokenizer, the blocks."""
    stats = {s.block: s for s in blocks}
    split = stats["split"].extra
    print(f"[data] {source}: {split['train']} train / {split['heldout']} held-out documents")
    for s in blocks:
        if s.block not in ("split", "tokenizer") and not s.block.startswith("pack"):
            print(f"[data] {s.summary()}")
    tok = stats["tokenizer"].extra
    trained = not any(stage.endswith("tokenizer") for stage in reused) and "reused" not in tok
    measured = f"{tok['bytes_per_token']:.2f} bytes/token" if tok.get("bytes_per_token") else "no text to measure"
    print(
        f"[tokenizer] {'trained' if trained else 'loaded'} byte-level BPE, {vocab} tokens; "
        f"{measured} on {tok.get('bytes_per_token_on')} text"
    )
    for name, block in (("train", "pack train"), ("held-out", "pack heldout")):
        c = stats[block].extra if block in stats else {"skipped": "no held-out document"}
        if "skipped" in c:
            print(f"[pack] {name}: evaluation skipped: {c['skipped']}")
            continue
        print(
            f"[pack] {name}: {c['tokens']:,} tokens -> {c['blocks']:,} blocks of {c['seq_len']} "
            f"({c['tail_tokens_dropped']:,} tail tokens dropped){' [reused cache]' if any(stage.endswith('pack') for stage in reused) else ''}"
        )


def model_config(model_args: ModelArguments, seq_len: int, tokenizer: PreTrainedTokenizerBase | None = None):
    """The model's config: the preset with the flags applied, sized for `tokenizer` (the preset's vocabulary
    without one, to check the flags before any data work)."""
    overrides = {
        k: v
        for k, v in (("window_pattern", model_args.window_pattern), ("sliding_window", model_args.sliding_window))
        if v is not None
    }
    if tokenizer is not None:
        overrides.update(
            vocab_size=64 * math.ceil(len(tokenizer) / 64),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    preset = load_config(model_args.preset)
    return load_config(
        model_args.preset,
        max_position_embeddings=max(preset.max_position_embeddings, seq_len),
        attention_backend=model_args.attention_backend,
        **overrides,
    )


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> PretrainForCausalLM:
    return PretrainForCausalLM(model_config(model_args, seq_len, tokenizer))


def check_arguments(
    model_args: ModelArguments, data_args: DataArguments, args: PretrainingArguments | None = None, dtype: str = "fp32"
) -> None:
    """Every flag the run uses that can be checked without data, checked before any data work (which takes
    minutes): the model flags (preset, window pattern, sliding window, attention backend: the kernel must run
    here), --seq_len (above the preset's positions: extended, with a warning), --vocab_size, --heldout_fraction,
    --num_proc, --dataset_path, and the run's estimated memory against what this machine has free."""
    config = model_config(model_args, data_args.seq_len)
    check_seq_len(data_args.seq_len)
    positions = load_config(model_args.preset).max_position_embeddings
    if data_args.seq_len > positions and (args is None or args.process_index == 0):
        print(
            f"warning: --seq_len {data_args.seq_len} is above the {positions} positions of --preset "
            f"{model_args.preset}: the model is built with max_position_embeddings={data_args.seq_len} (rotary "
            "positions need no new weights; attention and activations grow with it).",
            file=sys.stderr,
        )
    if data_args.vocab_size is not None and not data_args.tokenizer_name_or_path:
        check_vocab_size(data_args.vocab_size)
    check_fraction(data_args.heldout_fraction, "--heldout_fraction")
    if data_args.num_proc is not None and data_args.num_proc < 1:
        raise ValueError(f"--num_proc={data_args.num_proc}: use a number of worker processes >= 1.")
    if data_args.dataset_path:
        list_files(data_args.dataset_path, field="--dataset_path")
    if data_args.mixture:
        check_mixture_flags(data_args.mixture, data_args.dataset_path)
    if args is not None:
        env = Environment.detect(args.device, getattr(torch, {"bf16": "bfloat16"}.get(dtype, "float32")), training=True)
        plan = plan_attention(config, env, packed=data_args.separate_documents)  # a kernel that cannot run here
        check_run_memory(config, plan, data_args.seq_len, args)
        check_resume(args)


def check_run_memory(config: PretrainConfig, plan: dict, seq_len: int, args: PretrainingArguments) -> None:
    """The trainer's memory preflight (hf_pretrain.preflight.memory) before any data work; under
    DeepSpeed or FSDP the trainer checks it when training starts, once the sharding is known."""
    if args.memory_preflight == "ignore" or any(sharding_requested(args)):
        return
    check = check_memory(config, RunShape.of_run(args, config, plan, seq_len), args.device)
    warn = (lambda text: print(f"warning: {text}", file=sys.stderr)) if args.process_index == 0 else (lambda _: None)
    enforce_memory_policy(check, args.memory_preflight, warn)


def nats_versus(loss: float, entropy: float) -> str:
    """How far the held-out loss is below (learned more than token frequencies) or above the unigram entropy."""
    gap = entropy - loss
    return f"{abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} it"


def sample(model, tokenizer, prompts=PROMPTS, max_new_tokens: int = 24) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
        with torch.no_grad():
            gen = model.generate(
                **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        out[prompt] = tokenizer.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def fail(error: BaseException) -> NoReturn:
    """A mistake of the command line, the data or the machine: one line naming the flag and the fix, exit 2."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    try:  # bad flags or data: one line naming the flag or file, no traceback
        model_args, data_args, args = parse_args(argv)
        dtype, args = resolve_dtype(model_args, args)
        check_arguments(model_args, data_args, args, dtype)
        tokenizer, train, heldout = prepare_data(data_args, args, load_config(model_args.preset).vocab_size)
    except (ValueError, FileNotFoundError) as err:
        fail(err)
    set_seed(args.seed)  # the initial weights, not only the data order, follow --seed
    model = build_model(model_args, tokenizer, data_args.seq_len)
    # pad_token_id: rows of best-fit sources (a mixture's) differ in length; padding is counted as no token
    collator = PackedDocumentCollator(
        tokenizer.eos_token_id, separate_documents=data_args.separate_documents, pad_token_id=tokenizer.pad_token_id
    )
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=heldout,
        data_collator=collator,
        processing_class=tokenizer,
    )
    if args.process_index == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"[model] preset {model_args.preset}: {n_params / 1e6:.2f} M parameters, layers {model.config.window_pattern!r}, "
            f"{dtype}{f' ({args.precision} recipe)' if args.precision else ''}, {args.world_size} process(es) on "
            f"{args.device.type}, attention {model.config.attention_backend}"
        )
    resume = resume_target(args.resume_from_checkpoint)
    try:  # a checkpoint that cannot be resumed, a run that cannot fit, a full disk: one line each
        result = trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(args.output_dir)
    except (CheckpointError, MemoryPreflightError) as err:
        fail(err)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        fail(err)
    summary = {
        "train_loss": result.training_loss,
        "train_seconds": result.metrics["train_runtime"],
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "world_size": args.world_size,
    }
    if heldout is not None:
        metrics = trainer.evaluate()
        entropy = unigram_entropy(train)
        summary.update(
            heldout_loss=metrics["eval_loss"],
            heldout_perplexity=math.exp(metrics["eval_loss"]),
            unigram_entropy=entropy,
        )
    with high_precision(trainer.model):  # on every rank: under ZeRO-3 / FSDP each forward needs all of them
        summary["samples"] = sample(trainer.model, tokenizer)
    if trainer.is_world_process_zero():
        if heldout is not None:
            print(
                f"[eval] held-out loss {summary['heldout_loss']:.3f} nats/token (perplexity {summary['heldout_perplexity']:.1f}); "
                f"unigram entropy of the corpus {entropy:.3f} nats/token (perplexity {math.exp(entropy):.1f}): "
                f"{nats_versus(summary['heldout_loss'], entropy)}"
            )
        for prompt, completion in summary["samples"].items():
            print(f"[sample] {prompt!r} -> {completion!r}")
        Path(args.output_dir, "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[saved] model + tokenizer in {args.output_dir}")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # ranks leave the process group together (no teardown at interpreter exit)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:] or None)
