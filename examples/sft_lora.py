"""LoRA chat fine-tune of an hf_pretrain checkpoint: `python examples/sft_lora.py`.

With no arguments it runs end to end on a CPU in a few minutes: it pretrains a `tiny` base with
`examples/pretrain.py`'s `main()` (its defaults, 150 steps instead of 300; saved in
`<output_dir>/base` and reused when it is there), makes a small chat data set locally, saves a chat
template into the tokenizer, trains LoRA adapters on the assistant tokens only (with
`PretrainTrainer`, which takes a `PeftModel` as it is), merges them into the weights and saves a
plain hf_pretrain checkpoint, exports that to a `llama` checkpoint, and measures greedy exact-match
answers before and after, on trained and held-out chats. `--base_model PATH` fine-tunes an existing
checkpoint (with its tokenizer) instead. docs/finetuning.md shows a run.

The data (`make_chat_data`): four templated tasks, generated from a seed, one user turn and one
assistant turn each (100 chats per task, 20 of them held out: other instances of the same template,
never trained on).
- add      "What is 3 plus 4?" -> "7"                  (single digits: a table of 100 facts)
- next     "What number comes after 41?" -> "42"      (0..98: copy the tens, increment the units)
- larger   "Which is larger, 37 or 52?" -> "52"        (compare, then copy one of the two numbers)
- repeat   'Repeat after me: "red fox"' -> "red fox"  (copy two of 20 words)
Why a 1.8 M-parameter model learns this in a few hundred LoRA steps: answers are one to four
tokens, the tokenizer splits digits one per token (a number is its digit sequence), and three tasks
are copying with a small rule, which attention learns and which carries over to unseen instances.
An unseen `add` fact can only come from the trained ones (its commuted pair is in training for 14
of the 20 held-out facts), so `add` is the task that generalises least.

The chat template reuses the tokenizer's own `<|bos|>` and `<|eos|>` with plain-text role lines:

    <|bos|>User:
    What is 3 plus 4?
    Assistant:
    7<|eos|>

No token is added, so the embedding matrix and the LM head keep their shape and nothing needs
`modules_to_save` (a new special token would need a resized embedding trained in full, then carried
whole by every adapter). `<|eos|>` ends the assistant turn, so `generate` stops on the model's own
`eos_token_id`; the role lines end in a newline, so the generation prompt tokenizes as an exact
prefix of a trained chat. The assistant turn is wrapped in `{% generation %}`:
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens that get a loss (the
answer and its `<|eos|>`), every other label is -100.

LoRA targets every linear of the blocks and also the input embedding and the LM head (low-rank
deltas like the others, merged the same way). On this small base the embedding and head adapters
are what make the task learnable: with the seven block linears alone, 500 steps reached 0.14 exact
match on the trained chats where all nine targets reached 1.0 (docs/finetuning.md).

Layout of `--output_dir`: `base/` (when made here), `adapter/` (the LoRA adapter, peft format),
`merged/` (hf_pretrain checkpoint + tokenizer with the chat template), `exported/` (plain `llama`
checkpoint + tokenizer), `sft_summary.json` (the numbers printed). The top of this module imports
only torch and transformers: `check_with_plain_transformers` runs in a fresh interpreter in which
peft cannot be imported, loads `exported/` before hf_pretrain is imported, then `merged/`.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

HERE = Path(__file__).resolve().parent

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ 'Assistant:\\n' }}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ message['role'] | capitalize }}{{ ':\\n' + message['content'] + '\\n' }}"
    "{% else %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:\\n' }}{% endif %}"
)

WORDS = "red blue green cat dog fox sun moon tree book fish bird king stone river apple bread light night hat".split()  # noqa: SIM905
TASKS = ("add", "next", "larger", "repeat")
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# LoRA also on the input embedding and the LM head (low-rank deltas, merged like the rest; see the module docstring).
TARGET_MODULES = [*LLAMA_LINEARS, "embed_tokens", "lm_head"]

# Defaults of this example's training run; any of them can be overridden on the command line.
EXAMPLE_DEFAULTS = dict(
    output_dir="runs/sft_lora",
    max_steps=800,
    per_device_train_batch_size=32,
    learning_rate=3e-3,
    warmup_steps=20,
    lr_scheduler_type="cosine",
    weight_decay=0.0,
    max_grad_norm=1.0,
    logging_steps=50,
    save_strategy="no",
    eval_strategy="no",
    report_to="none",
    seed=42,
    dataloader_num_workers=0,
    remove_unused_columns=False,
)


@dataclass
class SFTArguments:
    base_model: str | None = field(
        default=None,
        metadata={
            "help": "An hf_pretrain checkpoint with its tokenizer. Default: pretrain a tiny base with "
            "examples/pretrain.py into <output_dir>/base (reused when it exists)."
        },
    )
    base_steps: int = field(default=150, metadata={"help": "Pretraining steps of the default base."})
    examples_per_task: int = field(default=100, metadata={"help": "Chat examples made per task (before the split)."})
    heldout_fraction: float = field(default=0.2, metadata={"help": "Fraction of each task's examples held out."})
    chat_seed: int = field(default=0, metadata={"help": "Seed of the generated chat data."})
    show: int = field(default=2, metadata={"help": "Examples of each task and split printed with their answers."})
    plain_check: bool = field(
        default=True, metadata={"help": "Load the exported folder in a fresh interpreter with plain transformers."}
    )


@dataclass
class LoraArguments:
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    target_modules: list[str] = field(
        default_factory=lambda: list(TARGET_MODULES),
        metadata={"help": "Modules that get adapters (linears and the embedding, by name)."},
    )


def parse_args(argv: list[str] | None = None):
    from hf_pretrain import PretrainingArguments

    parser = HfArgumentParser((SFTArguments, LoraArguments, PretrainingArguments))
    parser.set_defaults(**EXAMPLE_DEFAULTS)
    return parser.parse_args_into_dataclasses(args=argv)


# --- data -----------------------------------------------------------------------------------------


def _task_instances(task: str, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Up to `n` distinct (question, answer) pairs of `task`, in a seeded random order."""
    if task == "add":
        pairs = [(a, b) for a in range(10) for b in range(10)]
        items = [(f"What is {a} plus {b}?", str(a + b)) for a, b in pairs]
    elif task == "next":
        items = [(f"What number comes after {k}?", str(k + 1)) for k in range(99)]
    elif task == "larger":
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
        items = [(f"Which is larger, {a} or {b}?", str(max(a, b))) for a, b in rng.sample(pairs, 4 * n)]
    elif task == "repeat":
        pairs = [(a, b) for a in WORDS for b in WORDS if a != b]
        items = [(f'Repeat after me: "{a} {b}"', f"{a} {b}") for a, b in pairs]
    else:
        raise ValueError(f"unknown task {task!r}; tasks are {TASKS}")
    rng.shuffle(items)
    return items[:n]


def make_chat_data(examples_per_task: int = 100, heldout_fraction: float = 0.2, seed: int = 0) -> dict[str, list]:
    """{"train": [...], "heldout": [...]}, each item {"task", "messages"}: deterministic for a seed."""
    rng = random.Random(seed)
    splits = {"train": [], "heldout": []}
    for task in TASKS:
        items = _task_instances(task, rng, examples_per_task)
        n_heldout = max(1, round(heldout_fraction * len(items)))
        for i, (question, answer) in enumerate(items):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            splits["heldout" if i < n_heldout else "train"].append({"task": task, "messages": messages})
    rng.shuffle(splits["train"])
    return splits


def tokenize_chats(tokenizer, examples: list[dict]) -> list[dict]:
    """input_ids, attention_mask and labels (-100 outside the assistant's tokens) of each chat."""
    rows = []
    for example in examples:
        enc = tokenizer.apply_chat_template(
            example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        if not any(mask):
            raise ValueError("the chat template marked no assistant token: is {% generation %} in it?")
        labels = [t if m else -100 for t, m in zip(ids, mask, strict=True)]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


class PadCollator:
    """Right-pads a batch of tokenized chats: pad id in input_ids, 0 in the mask, -100 in the labels."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": -100}
        return {k: torch.tensor([r[k] + [v] * (width - len(r[k])) for r in rows]) for k, v in fill.items()}


# --- answers ---------------------------------------------------------------------------------------


def answer(model, tokenizer, examples: list[dict], batch_size: int = 64, max_new_tokens: int = 8) -> list[str]:
    """Greedy answers to the user turns of `examples` (chat template + generation prompt, left-padded batches)."""
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out = []
    try:
        for start in range(0, len(examples), batch_size):
            chats = [
                [m for m in e["messages"] if m["role"] != "assistant"] for e in examples[start : start + batch_size]
            ]
            batch = tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
            ).to(model.device)
            with torch.no_grad():
                gen = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            out += [
                t.strip()
                for t in tokenizer.batch_decode(gen[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            ]
    finally:
        tokenizer.padding_side = side
    return out


def exact_match(model, tokenizer, examples: list[dict]) -> dict:
    """Exact-match accuracy overall and per task, with the answers given."""
    given = answer(model, tokenizer, examples)
    right = [g == e["messages"][-1]["content"] for g, e in zip(given, examples, strict=True)]
    per_task = {}
    for task in TASKS:
        hits = [r for r, e in zip(right, examples, strict=True) if e["task"] == task]
        if hits:
            per_task[task] = sum(hits) / len(hits)
    return {"exact_match": sum(right) / max(len(right), 1), "per_task": per_task, "answers": given}


def check_with_plain_transformers(exported_dir: str, merged_dir: str, examples: list[dict]) -> dict:
    """Answer `examples` from the exported folder with transformers alone, then from the merged folder without peft.

    Meant for a fresh interpreter (`run_plain_check`) in which `import peft` fails: the exported `llama` folder loads
    before hf_pretrain is ever imported; the merged hf_pretrain folder then loads with hf_pretrain (its model type).
    """
    model = AutoModelForCausalLM.from_pretrained(exported_dir)
    result = exact_match(model, AutoTokenizer.from_pretrained(exported_dir), examples)
    result["exported_class"] = type(model).__name__
    result["exported_imported"] = sorted(name for name in ("hf_pretrain", "peft") if sys.modules.get(name))
    import hf_pretrain  # noqa: F401  (registers the hf_pretrain model type with the Auto classes)

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    merged_scores = exact_match(merged, AutoTokenizer.from_pretrained(merged_dir), examples)
    result["merged_class"] = type(merged).__name__
    result["merged_exact_match"] = merged_scores["exact_match"]
    result["merged_imported"] = sorted(name for name in ("hf_pretrain", "peft") if sys.modules.get(name))
    result["peft_blocked"] = "peft" in sys.modules and sys.modules["peft"] is None
    return result


PLAIN_CHECK = """
import importlib.util, json, sys
sys.modules["peft"] = None  # any `import peft` from here on raises ImportError
spec = importlib.util.spec_from_file_location("sft_lora_plain", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
print(json.dumps(module.check_with_plain_transformers(sys.argv[2], sys.argv[3], json.load(sys.stdin))))
"""


def run_plain_check(exported_dir: Path, merged_dir: Path, examples: list[dict]) -> dict:
    """`check_with_plain_transformers` in a fresh interpreter where peft cannot be imported at all."""
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_CHECK, str(Path(__file__).resolve()), str(exported_dir), str(merged_dir)],
        input=json.dumps(examples),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the check in a fresh interpreter failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["exported_imported"] or "peft" in result["merged_imported"] or not result["peft_blocked"]:
        raise RuntimeError(f"the fresh interpreter imported more than it should: {result}")
    return result


# --- the job ---------------------------------------------------------------------------------------


def pretrain_base(out_dir: Path, steps: int) -> Path:
    """A tiny base from examples/pretrain.py's main() (its defaults, `steps` steps), or the one already in `out_dir`."""
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        print(f"[base] reusing {out_dir}")
        return out_dir
    spec = importlib.util.spec_from_file_location("pretrain_example", HERE / "pretrain.py")
    pretrain = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pretrain  # dataclasses look their module up there
    spec.loader.exec_module(pretrain)
    print(f"[base] no --base_model: pretraining the tiny preset with examples/pretrain.py for {steps} steps")
    pretrain.main(["--output_dir", str(out_dir), "--max_steps", str(steps)])
    return out_dir


def print_scores(label: str, scores: dict) -> None:
    tasks = ", ".join(f"{t} {v:.2f}" for t, v in scores["per_task"].items())
    print(f"[eval] {label}: exact match {scores['exact_match']:.3f} ({tasks})")


def show_examples(examples: list[dict], before: list[str], after: list[str], per_task: int, label: str) -> None:
    rows = list(zip(examples, before, after, strict=True))
    for task in TASKS:
        for e, b, a in [row for row in rows if row[0]["task"] == task][:per_task]:
            want = e["messages"][-1]["content"]
            mark = "ok" if a == want else f"want {want!r}"
            print(f"[{label}] {e['messages'][0]['content']!r} -> {a!r} ({mark}; before SFT {b!r})")


def main(argv: list[str] | None = None) -> dict:
    try:
        import peft
    except ImportError as error:
        raise SystemExit(
            "examples/sft_lora.py needs peft: pip install 'hf_pretrain[lora]' (or pip install peft)."
        ) from error
    from transformers import set_seed

    from hf_pretrain import PretrainTrainer, export_hf

    sft_args, lora_args, args = parse_args(argv)
    start = time.perf_counter()
    out = Path(args.output_dir)
    timings = {}
    set_seed(args.seed)  # pretrain.py builds its model before its Trainer seeds: seeded here, the default base repeats
    base_dir = Path(sft_args.base_model) if sft_args.base_model else pretrain_base(out / "base", sft_args.base_steps)
    timings["base_s"] = time.perf_counter() - start
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    data = make_chat_data(sft_args.examples_per_task, sft_args.heldout_fraction, sft_args.chat_seed)
    train_rows = tokenize_chats(tokenizer, data["train"])
    print(
        f"[data] {len(data['train'])} train / {len(data['heldout'])} held-out chats, tasks {', '.join(TASKS)}; "
        f"{sum(sum(t != -100 for t in r['labels']) for r in train_rows)} of "
        f"{sum(len(r['input_ids']) for r in train_rows)} train tokens carry a loss (assistant turns)"
    )
    print("[template] " + repr(tokenizer.apply_chat_template(data["train"][0]["messages"], tokenize=False)))

    before = {name: exact_match(model, tokenizer, data[name]) for name in ("train", "heldout")}
    print_scores("before SFT, train", before["train"])
    print_scores("before SFT, held-out", before["heldout"])

    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=lora_args.target_modules,
    )
    model = peft.get_peft_model(model, config)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    print(
        f"[lora] r={config.r} alpha={config.lora_alpha} on {', '.join(sorted(config.target_modules))}: "
        f"trainable params {sum(trainable.values()):,} of {total:,} ({100 * sum(trainable.values()) / total:.2f} %) "
        f"in {len(trainable)} tensors"
    )

    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    t0 = time.perf_counter()
    result = trainer.train()
    timings["sft_s"] = time.perf_counter() - t0
    model.save_pretrained(out / "adapter")

    after_lora = {name: exact_match(model, tokenizer, data[name]) for name in ("train", "heldout")}
    merged = model.merge_and_unload()  # W + (alpha / r) B A in every adapted linear: a plain PretrainForCausalLM
    merged_dir, exported_dir = out / "merged", out / "exported"
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)
    print(f"[saved] merged model + tokenizer (with chat template) in {merged_dir}; adapter alone in {out / 'adapter'}")

    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    after = {name: exact_match(reloaded, reloaded_tokenizer, data[name]) for name in ("train", "heldout")}
    pairs = [(x, y) for name in after for x, y in zip(after[name]["answers"], after_lora[name]["answers"], strict=True)]
    agreement = sum(x == y for x, y in pairs) / len(pairs)
    print(f"[merge] the merged model, reloaded, gives the adapted model's answer on {agreement:.1%} of all chats")
    print_scores(f"after SFT (merged, reloaded as {type(reloaded).__name__}), train", after["train"])
    print_scores(f"after SFT (merged, reloaded as {type(reloaded).__name__}), held-out", after["heldout"])
    for name in ("train", "heldout"):
        show_examples(data[name], before[name]["answers"], after[name]["answers"], sft_args.show, name)

    export_hf(merged_dir, exported_dir)
    ids = reloaded_tokenizer.apply_chat_template(
        [e["messages"] for e in data["heldout"][:16]], padding=True, return_tensors="pt", return_dict=True
    )
    exported = AutoModelForCausalLM.from_pretrained(exported_dir)
    with torch.no_grad():
        diff = (reloaded(**ids).logits - exported(**ids).logits).abs().max().item()
    print(f"[export] {type(exported).__name__} in {exported_dir}: max |logit difference| vs merged {diff:.2e}")
    plain = None
    if sft_args.plain_check:
        plain = run_plain_check(exported_dir, merged_dir, data["heldout"])
        print(
            f"[export] fresh interpreter, peft blocked, hf_pretrain not imported: "
            f"{plain['exported_class']} from {exported_dir.name}/ answers the held-out set with exact match "
            f"{plain['exact_match']:.3f}; then with hf_pretrain, {plain['merged_class']} from {merged_dir.name}/ "
            f"{plain['merged_exact_match']:.3f}"
        )
    timings["total_s"] = time.perf_counter() - start
    print(
        f"[time] base {timings['base_s']:.0f} s, LoRA SFT {timings['sft_s']:.0f} s "
        f"({args.max_steps} steps), total {timings['total_s']:.0f} s"
    )

    def scores(s: dict) -> dict:
        return {k: v for k, v in s.items() if k != "answers"}

    summary = {
        "base_model": str(base_dir),
        **{k: getattr(sft_args, k) for k in ("examples_per_task", "heldout_fraction", "chat_seed")},
        "train_examples": len(data["train"]),
        "heldout_examples": len(data["heldout"]),
        "train_loss": result.training_loss,
        "lora": {**asdict(lora_args), "trainable_parameters": sum(trainable.values()), "total_parameters": total},
        "trainable_names": sorted(trainable),
        "before": {k: scores(v) for k, v in before.items()},
        "after": {k: scores(v) for k, v in after.items()},
        "merge_answer_agreement": agreement,
        "export_max_abs_logit_diff": diff,
        "fresh_interpreter": {k: v for k, v in plain.items() if k != "answers"} if plain else None,
        "timings": timings,
    }
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:] or None)
