"""Forward + backward time of each attention kernel that runs here, for full and windowed layers.

Layer mode (default) times one attention call (kernel + its mask) on random q/k/v for a full
causal layer and a window layer, per backend usable on this device, and prints tokens/s and the
time ratio against the fastest backend of that layer kind. Model mode (`--model`) times whole
training steps (forward + backward) of the gpt2-124m shape with windows SSSL/W on flex (sparse
windows), on SDPA with dense window masks, without windows on SDPA `is_causal`, and on `auto`
(FA when installed): the GPU check of the attention issue.

    python benchmarks/attention.py                               # CPU: sdpa, eager at 1024 / window 256
    python benchmarks/attention.py --seq-len 2048 --window 512 --model --dtype bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.modeling.attention import (
    BACKENDS,
    FULL,
    SLIDING,
    Environment,
    LayerNeed,
    attention_forward,
    build_attention_masks,
    config_for_backend,
    unavailable_reason,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (and compile, for flex)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def window_pair(window: int, heads: int, head_dim: int, seq_len: int):
    """Two layers, sliding (0) then full (1), of the attention shape under test (also used by gpu_check.py)."""
    return get_preset(
        "gpt2-124m",
        num_hidden_layers=2,
        window_pattern="SL",
        sliding_window=window,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        hidden_size=heads * head_dim,
        max_position_embeddings=seq_len,
    )


def layer_times(a, device: str, dtype: torch.dtype) -> None:
    config = window_pair(a.window, a.heads, a.head_dim, a.seq_len)
    model = PretrainForCausalLM(config).to(device)
    env = Environment.detect(device, dtype, training=True)
    shape = (a.batch, a.heads, a.seq_len, a.head_dim)
    embeds = torch.empty(a.batch, a.seq_len, 1, device=device, dtype=dtype)
    for kind, layer in ((FULL, model.model.layers[1]), (SLIDING, model.model.layers[0])):
        need = LayerNeed(kind, config.sliding_window if kind == SLIDING else None, packed=False)
        results = {}
        for backend in BACKENDS:
            why_not = unavailable_reason(backend, need, env, requested=True)
            if why_not:
                print(f"  {need.label:>11} {backend:<18} skipped: {why_not}")
                continue
            attn = layer.self_attn
            attn.config = config_for_backend(config, backend)
            mask = build_attention_masks({kind: attn.config}, embeds, None, None, None)[kind]
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

            def step(attn=attn, mask=mask, q=q, k=k, v=v):
                out, _ = attention_forward(attn, q, k, v, mask)
                out.float().sum().backward()

            results[backend] = median_time(step, device, a.repeats)
        best = min(results.values())
        for backend, seconds in sorted(results.items(), key=lambda kv: kv[1]):
            print(
                f"  {need.label:>11} {backend:<18} {seconds * 1e3:9.2f} ms  {a.batch * a.seq_len / seconds:12,.0f} tokens/s  "
                f"{seconds / best:5.2f}x the fastest"
            )


def model_times(a, device: str, dtype: torch.dtype) -> None:
    variants = {
        f"SSSL W={a.window}, flex (sparse windows)": dict(window_pattern="SSSL", attention_backend="flex_attention"),
        f"SSSL W={a.window}, SDPA dense masks": dict(window_pattern="SSSL", attention_backend="sdpa"),
        "L (no windows), SDPA is_causal": dict(window_pattern="L", attention_backend="sdpa"),
        f"SSSL W={a.window}, auto kernels": dict(window_pattern="SSSL", attention_backend="auto"),
    }
    ids = torch.randint(0, 50304, (a.batch, a.seq_len), device=device)
    results = {}
    for name, overrides in variants.items():
        config = get_preset("gpt2-124m", sliding_window=a.window, max_position_embeddings=a.seq_len, **overrides)
        model = PretrainForCausalLM(config).to(device).train()

        def step(model=model):
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                model(input_ids=ids, labels=ids).loss.backward()

        results[name] = median_time(step, device, a.repeats)
        plan = {t: c.backend for t, c in model.attention_plan.items()} if model.attention_plan else {}
        print(f"  {name:<34} {results[name] * 1e3:9.1f} ms/step   kernels {plan}")
        del model
    dense = results[f"SSSL W={a.window}, SDPA dense masks"]
    for name, seconds in results.items():
        print(f"  {name:<34} dense-mask step / this step = {dense / seconds:5.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--model", action="store_true", help="time whole gpt2-124m training steps instead of layers")
    a = parser.parse_args(argv)
    dtype = DTYPES[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"{name}, {dtype}, torch {torch.__version__}, seq {a.seq_len}, window {a.window}, batch {a.batch}")
    (model_times if a.model else layer_times)(a, a.device, dtype)


if __name__ == "__main__":
    main()
