"""`examples/sft_lora.py`: LoRA chat fine-tune, merge, export; end to end and its data/label pieces."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_pretrain import PretrainForCausalLM

ROOT = Path(__file__).resolve().parents[1]
# The base is a 2-step pretrain (near-random weights): the default path (pretrain.py's main()) runs, cheaply, and
# everything the answers learn comes from the adapters. docs/finetuning.md has the numbers of the default run.
# 300 LoRA steps learn the answers (make test-all); 20 check the whole path (make test).
SHORT = ["--base_steps", "2", "--logging_steps", "10"]
LEARNS = 300


def example_module():
    spec = importlib.util.spec_from_file_location("sft_lora_example", ROOT / "examples" / "sft_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def expected_lora_parameters(config, r: int, targets: list[str]) -> int:
    """r * (fan_in + fan_out) of every adapted module, from the model's shapes."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = dict(q_proj=h + q, k_proj=h + kv, v_proj=h + kv, o_proj=q + h, gate_proj=h + i, up_proj=h + i)
    per_layer["down_proj"] = i + h
    once = dict(embed_tokens=v + h, lm_head=h + v)
    return r * sum(config.num_hidden_layers * per_layer.get(t, 0) + once.get(t, 0) for t in targets)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [20, pytest.param(LEARNS, marks=pytest.mark.exhaustive)])
def test_lora_sft_merges_exports_and_answers(tmp_path, steps):
    out = tmp_path / "sft"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "examples" / "sft_lora.py"), "--output_dir", str(out), *SHORT]
    cmd += ["--max_steps", str(steps)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "sft_summary.json").read_text())
    example = example_module()

    # The merged folder is a plain hf_pretrain checkpoint: no adapter files, no LoRA weights, no PeftModel.
    merged_dir, exported_dir = out / "merged", out / "exported"
    assert (out / "adapter" / "adapter_config.json").exists()
    assert not [p.name for p in merged_dir.iterdir() if p.name.startswith("adapter")]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert type(merged) is PretrainForCausalLM
    assert not [n for n, _ in merged.named_parameters() if "lora" in n]
    fresh = summary["fresh_interpreter"]  # a new interpreter where `import peft` fails
    assert fresh["peft_blocked"] and fresh["exported_imported"] == [] and "peft" not in fresh["merged_imported"]
    assert fresh["exported_class"] == "LlamaForCausalLM" and fresh["merged_class"] == "PretrainForCausalLM"

    # The chat template round-trips through save_pretrained, in both folders.
    chat = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]
    for folder in (merged_dir, exported_dir):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.chat_template == example.CHAT_TEMPLATE
        assert tokenizer.apply_chat_template(chat, tokenize=False) == (
            "<|bos|>User:\nWhat is 2 plus 2?\nAssistant:\n4<|eos|>\n"
        )
        assert tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True).endswith(
            "?\nAssistant:\n"
        )

    # LoRA changed the answers: exact match on the trained chats rose by a wide margin, and the merged model (reloaded
    # from disk) is what was measured; the exported model answers the held-out chats the same way.
    before, after = summary["before"], summary["after"]
    if steps >= LEARNS:
        assert after["train"]["exact_match"] >= before["train"]["exact_match"] + 0.3, (before, after)
    assert summary["merge_answer_agreement"] == 1.0  # merging changed no answer (same CPU, same batches)
    assert fresh["exact_match"] == fresh["merged_exact_match"] == after["heldout"]["exact_match"]

    # Only the LoRA matrices trained, and exactly as many weights as the adapted shapes give.
    lora = summary["lora"]
    assert all(".lora_" in name for name in summary["trainable_names"])
    assert len(summary["trainable_names"]) == 2 * (merged.config.num_hidden_layers * 7 + 2)
    assert lora["trainable_parameters"] == expected_lora_parameters(
        merged.config, lora["lora_r"], lora["target_modules"]
    )

    # The plain-llama export computes the merged model's logits.
    exported = AutoModelForCausalLM.from_pretrained(exported_dir)
    data = example.make_chat_data(summary["examples_per_task"], summary["heldout_fraction"], summary["chat_seed"])
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    batch = tokenizer.apply_chat_template(
        [e["messages"] for e in data["heldout"][:24]], padding=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        diff = (merged(**batch).logits - exported(**batch).logits).abs().max().item()
    assert diff < 1e-5, diff

    # A second run reuses the base it made.
    assert example.pretrain_base(out / "base", 2) == out / "base"


def test_chat_data_and_labels(tmp_path):
    from hf_pretrain.data import train_bpe_tokenizer

    example = example_module()
    data = example.make_chat_data(examples_per_task=40, heldout_fraction=0.25, seed=3)
    assert data == example.make_chat_data(examples_per_task=40, heldout_fraction=0.25, seed=3)  # deterministic
    assert len(data["train"]) == 4 * 30 and len(data["heldout"]) == 4 * 10
    questions = {name: {e["messages"][0]["content"] for e in rows} for name, rows in data.items()}
    assert not questions["train"] & questions["heldout"]  # nothing held out is trained on

    text = " ".join(e["messages"][0]["content"] + " " + e["messages"][1]["content"] for e in data["train"])
    tokenizer = train_bpe_tokenizer([text] * 20, 300)
    tokenizer.chat_template = example.CHAT_TEMPLATE
    rows = example.tokenize_chats(tokenizer, data["train"][:20])
    for row, e in zip(rows, data["train"][:20], strict=True):
        learned = [t for t in row["labels"] if t != -100]
        # The loss covers the answer and the end of the turn, nothing of the prompt.
        assert tokenizer.decode(learned) == e["messages"][1]["content"] + "<|eos|>"
        prompt = tokenizer.apply_chat_template(e["messages"][:1], add_generation_prompt=True, return_dict=True)
        prompt = list(prompt["input_ids"])
        assert row["input_ids"][: len(prompt)] == prompt and row["labels"][: len(prompt)] == [-100] * len(prompt)
    batch = example.PadCollator(tokenizer.pad_token_id)(rows[:4])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert ((batch["attention_mask"] == 0) <= (batch["labels"] == -100)).all()
