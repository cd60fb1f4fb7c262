"""The one attention entry point of the model, and the choice of kernel for each layer type.

Kernels are transformers' own, looked up by name (`flash_attention_3`, `flash_attention_2`,
`flex_attention`, `sdpa` in `ALL_ATTENTION_FUNCTIONS`, plus `eager`), so hf_pretrain inherits
their fixes: FA2/FA3 take `sliding_window` natively and run packed rows as varlen (`cu_seqlens`
derived from restarting `position_ids`); flex gets a block-sparse `BlockMask`; SDPA gets
`is_causal` for a plain causal layer and a boolean mask for windows or packed documents; eager
gets an additive mask. Masks come from `transformers.masking_utils`, built once per forward for
each layer type (full / sliding) in the format of that type's kernel, so a model can run FA or
SDPA on its full layers and flex on its window layers.

`choose_backend` decides, for one layer type, which kernel runs and why. With
`attention_backend="auto"` (PretrainConfig's default) it takes the fastest kernel that is
installed and can do what the layer needs (device, dtype, window, packed documents, training):

    windows or packed documents:  FA3 > FA2 > flex > SDPA (dense mask) > eager
    plain causal layer:           FA3 > FA2 > SDPA (is_causal) > flex > eager

FA3 needs a Hopper GPU (compute capability 9.x) and bf16/fp16; FA2 an Ampere-or-newer GPU and
bf16/fp16; flex a CUDA GPU (on CPU it has no backward; `auto` leaves it to CUDA, an explicit
request runs it for CPU inference).
Every choice carries whether it is exact (always, here: no backend approximates) and efficient (no
work on masked-out scores), and the reasons other kernels were passed over. `best_backend`
answers the same question as if every kernel package were installed: the gap between the two is
what `hf_pretrain.preflight` prices and warns about.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .accounting import FULL, SLIDING, layer_windows

BACKENDS = ("flash_attention_3", "flash_attention_2", "flex_attention", "sdpa", "eager")
KERNEL_PACKAGES = {"flash_attention_3": "flash_attn_interface", "flash_attention_2": "flash_attn"}
HALF_DTYPES = (torch.bfloat16, torch.float16)


class BackendUnavailableError(ValueError):
    """A requested attention kernel cannot run on this device, dtype or installation."""


@dataclass(frozen=True)
class Environment:
    """What the kernels depend on: device, GPU capability, compute dtype, mode, installed kernels."""

    device: str
    dtype: torch.dtype
    training: bool
    capability: tuple[int, int] | None = None
    kernel_versions: dict[str, str | None] = field(default_factory=dict)  # package -> version, None = missing
    torch_has_flex: bool = True

    @classmethod
    def detect(cls, device: str | torch.device, dtype: torch.dtype, training: bool) -> Environment:
        device = torch.device(device).type
        capability = torch.cuda.get_device_capability() if device == "cuda" and torch.cuda.is_available() else None
        return cls(device, dtype, training, capability, dict(installed_kernels()), flex_available())

    def with_all_kernels(self) -> Environment:
        """The same machine with every kernel package installed (what the hardware could do)."""
        return Environment(
            self.device,
            self.dtype,
            self.training,
            self.capability,
            dict.fromkeys(KERNEL_PACKAGES.values(), "any"),
            True,
        )


@functools.cache
def installed_kernels() -> dict[str, str | None]:
    """Version of each FlashAttention module that really imports here; None when missing or broken."""
    versions = {}
    for package in KERNEL_PACKAGES.values():
        try:
            module = importlib.import_module(package)
        except Exception:  # missing, or a build that does not load (wrong CUDA / torch ABI)
            versions[package] = None
            continue
        versions[package] = getattr(module, "__version__", None) or _distribution_version(package)
    return versions


def _distribution_version(package: str) -> str:
    for dist in (package, package.replace("_", "-"), "flash_attn_3", "flash-attn-3"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@dataclass(frozen=True)
class LayerNeed:
    """What a layer type asks of its kernel."""

    layer_type: str
    window: int | None
    packed: bool

    @property
    def label(self) -> str:
        return "full" if self.window is None else f"window {self.window}"

    @property
    def sparse(self) -> bool:
        """True when a dense causal kernel would compute scores the layer masks out."""
        return self.window is not None or self.packed


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    efficient: bool
    exact: bool = True
    passed_over: dict[str, str] = field(default_factory=dict)  # backend -> why it was not taken


def unavailable_reason(backend: str, need: LayerNeed, env: Environment, requested: bool = False) -> str | None:
    """Why `backend` cannot (or, for `auto`, should not) run `need` on `env`; None when it can."""
    if backend in KERNEL_PACKAGES:
        package = KERNEL_PACKAGES[backend]
        if env.device != "cuda":
            return f"needs a CUDA GPU (device is {env.device})"
        major = env.capability[0] if env.capability else 0
        if backend == "flash_attention_3" and major != 9:
            return f"needs a Hopper GPU, compute capability 9.x (this one is {env.capability})"
        if backend == "flash_attention_2" and major < 8:
            return f"needs compute capability >= 8.0 (this one is {env.capability})"
        if env.dtype not in HALF_DTYPES:
            return f"needs bf16/fp16 activations (dtype is {str(env.dtype).removeprefix('torch.')})"
        if env.kernel_versions.get(package) is None:
            return f"package {package} is not installed (or does not import)"
    if backend == "flex_attention":
        if not env.torch_has_flex:
            return "this torch has no torch.nn.attention.flex_attention"
        if env.device == "cpu" and env.training:
            return "flex_attention has no backward on CPU (inference only)"
        if env.device != "cuda" and not requested:
            return f"on {env.device} flex_attention compiles to a kernel slower than SDPA; auto uses it on CUDA only"
    return None


def is_efficient(backend: str, need: LayerNeed) -> bool:
    """Whether the kernel skips masked-out scores (SDPA does only for a plain causal layer)."""
    if backend == "eager":
        return False
    if backend == "sdpa":
        return not need.sparse
    return True


def preference(need: LayerNeed) -> tuple[str, ...]:
    if need.sparse:
        return BACKENDS
    return ("flash_attention_3", "flash_attention_2", "sdpa", "flex_attention", "eager")


def choose_backend(need: LayerNeed, env: Environment, requested: str = "auto") -> Choice:
    """The kernel for one layer type: the first usable in `preference(need)`, or the one requested."""
    passed_over = {}
    candidates = preference(need) if requested == "auto" else (requested,)
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend={requested!r} is unknown; use 'auto' or one of {list(BACKENDS)}.")
    for backend in candidates:
        why_not = unavailable_reason(backend, need, env, requested=requested != "auto")
        if why_not:
            passed_over[backend] = why_not
            continue
        efficient = is_efficient(backend, need)
        if requested != "auto":
            reason = "requested"
        elif not passed_over:
            reason = "fastest kernel for this layer"
        else:
            reason = "fastest available; " + "; ".join(f"{b}: {r}" for b, r in passed_over.items())
        if not efficient:
            reason += (
                f" ({'dense mask' if backend == 'sdpa' else 'materialises all scores'}: computes masked-out scores)"
            )
        return Choice(backend, reason, efficient, True, passed_over)
    raise BackendUnavailableError(
        f"attention_backend={requested!r} cannot run the {need.label} layers here: {passed_over[requested]}. "
        "Use attention_backend='auto' or install the kernel."
    )


def best_backend(need: LayerNeed, env: Environment) -> Choice:
    """What `auto` would choose on this hardware with every kernel package installed."""
    return choose_backend(need, env.with_all_kernels())


def layer_needs(config, packed: bool) -> dict[str, LayerNeed]:
    """One need per layer type present in the model."""
    windows = dict(zip(config.layer_types, layer_windows(config)))  # one window per layer type
    return {t: LayerNeed(t, window, packed) for t, window in windows.items()}


def plan_attention(config, env: Environment, packed: bool, requested: str | None = None) -> dict[str, Choice]:
    """The kernel of each layer type for `requested` (default `config.attention_backend`) on `env`."""
    requested = requested or config.attention_backend
    return {t: choose_backend(need, env, requested) for t, need in layer_needs(config, packed).items()}


def config_for_backend(config, backend: str | None):
    """A shallow copy of `config` whose `_attn_implementation` names `backend` (what kernels and mask builders read)."""
    view = copy.copy(config)
    view._attn_implementation = backend
    return view


def attention_backend(implementation: str | None) -> Callable:
    """The kernel function for a backend name (eager when unset)."""
    if implementation in (None, "eager"):
        return eager_attention_forward
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attn_implementation={implementation!r} is unknown; use one of {list(BACKENDS)}.")
    return ALL_ATTENTION_FUNCTIONS[implementation]


def build_attention_masks(configs: dict, inputs_embeds, attention_mask, cache, position_ids) -> dict:
    """One mask per layer type, in the format of that type's kernel (`configs`: layer type -> config view).

    Packed documents are detected by transformers from `position_ids` that restart inside a row
    (with no 2D `attention_mask` and no cache) and become block-diagonal (SDPA/eager), document
    (flex) or varlen (FA) masks. A mask dict prepared by `generate` passes through.
    """
    if isinstance(attention_mask, dict):
        return attention_mask
    builders = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
    return {
        t: builders[t](
            config=view,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        for t, view in configs.items()
    }


def attention_forward(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """Run attention for one layer: (batch, heads, seq, head_dim) in, (batch, seq, heads, head_dim) out.

    `module` carries `config` (whose `_attn_implementation` names the kernel of its layer type),
    `scaling`, `num_key_value_groups`, `sliding_window` (None on full layers), `is_causal` and
    `layer_idx`: the attributes transformers' kernels read.
    """
    kernel = attention_backend(module.config._attn_implementation)
    return kernel(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=module.scaling,
        dropout=module.attention_dropout if module.training else 0.0,
        sliding_window=module.sliding_window,
        **kwargs,
    )
