"""`PretrainForCausalLM`: a Llama-architecture decoder with per-layer sliding windows.

Pre-norm RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, untied embeddings. Parameter names are
those of `transformers.LlamaForCausalLM` (`model.layers.N.self_attn.q_proj.weight`, ...), so a
checkpoint with `window_pattern="L"` loads in plain `LlamaForCausalLM` with identical logits.

What is reused from transformers and what is ours:
- reused: `LlamaRMSNorm`, `LlamaMLP` (SwiGLU), `LlamaRotaryEmbedding` / `apply_rotary_pos_emb`
  (every RoPE scaling type), the mask builders and the attention kernels (see `attention.py`),
  `DynamicCache` and `GenerationMixin`. Sharing them is what makes the logits match Llama's.
- ours: the attention layer, which knows its own `sliding_window` and calls the single
  `attention_forward` entry point, and the model loop, which hands each layer the mask of its
  type (full or sliding) the way transformers' Ministral does. Plain Llama ignores
  `sliding_window`; this model never does.

With `num_experts > 0` the layers that `config.mlp_layer_types` marks `"sparse"` use `PretrainMoE`
(`moe.py`) instead of `LlamaMLP`; they return their router logits next to the hidden states, the
model collects them, and `PretrainForCausalLM` turns them into the load-balancing and z losses (added
to the LM loss in training), the expert load and the dropped fraction (`PretrainMoeCausalLMOutput`),
and into the running sums of `model.moe_metrics` that `telemetry.moe.MoECallback` logs. Dense models
(`num_experts=0`) compute exactly what they computed before.

The loss: in training with labels (`config.chunked_loss`, the default) the head and the cross-entropy
are computed together from the hidden states in chunks (`loss.py`), never materialising the
[tokens, vocab] logits; the output's `logits` is then None. Evaluation, forwards without labels,
`logits_to_keep` and `skip_logits=False` compute the logits with `lm_head` and transformers'
`loss_function` as before.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import logging

from .accounting import layer_windows
from .attention import (
    BACKENDS,
    KERNEL_PACKAGES,
    BackendUnavailableError,
    Choice,
    Environment,
    attention_forward,
    build_attention_masks,
    config_for_backend,
    plan_attention,
)
from .configuration import PretrainConfig
from .loss import causal_lm_loss, unavailable_reason
from .moe import MoEMetrics, PretrainExperts, PretrainMoE, PretrainMoeCausalLMOutput, PretrainRouter, routing_statistics

logger = logging.get_logger(__name__)

# The model whose __init__ is the outermost one running in this thread (a PretrainForCausalLM builds a PretrainModel).
_BUILDING: ContextVar[nn.Module | None] = ContextVar("hf_pretrain_building", default=None)


class PretrainAttention(nn.Module):
    """Multi-head attention with GQA and RoPE; `sliding_window` is None on full layers."""

    def __init__(self, config: PretrainConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = layer_windows(config)[layer_idx]
        bias = config.attention_bias
        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=bias)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        output, weights = attention_forward(self, query, key, value, attention_mask, **kwargs)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class PretrainDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); an MoE layer also returns its router logits."""

    def __init__(self, config: PretrainConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.self_attn = PretrainAttention(config, layer_idx)
        self.mlp = PretrainMoE(config) if self.is_moe else LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, **kwargs
        )
        hidden_states = hidden_states + attn_out
        if self.is_moe:
            mlp_out, router_logits = self.mlp(self.post_attention_layernorm(hidden_states))
            return hidden_states + mlp_out, router_logits
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PretrainPreTrainedModel(PreTrainedModel):
    config: PretrainConfig
    config_class = PretrainConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PretrainDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PretrainExperts):  # 3D expert tensors and the router: normal(0, initializer_range)
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, PretrainRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        # transformers' `attn_implementation=` (from_pretrained, from_config, set_attn_implementation) asks for one
        # kernel everywhere ("auto": hf_pretrain's per-layer-type choice): record it as `attention_backend`. Only the
        # outermost init sees the user's request; a nested PretrainModel init sees the default transformers filled in.
        # Which init is outermost is this thread's bookkeeping (`_BUILDING`), never written into the config.
        first = _BUILDING.get() is None
        if is_init_check and first:
            _BUILDING.set(self)
        if attn_implementation in ("auto", *BACKENDS) and (first or not is_init_check):
            self.config.attention_backend = attn_implementation
        if attn_implementation == "auto":
            attn_implementation = None  # transformers' own default for the fields it reads
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check=is_init_check, **kwargs)

    def _end_of_init(self) -> None:
        if _BUILDING.get() is self:  # the outermost init is over: the next model built is outermost again
            _BUILDING.set(None)


class PretrainModel(PretrainPreTrainedModel):
    """The decoder stack without the LM head (`LlamaModel`'s parameter names)."""

    def __init__(self, config: PretrainConfig):
        try:
            super().__init__(config)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            self.layers = nn.ModuleList(PretrainDecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.rotary_emb = LlamaRotaryEmbedding(config=config)
            self.gradient_checkpointing = False
            self.attention_plan: dict[str, Choice] | None = None
            self._plan_key = None
            self.post_init()
        finally:
            self._end_of_init()

    def set_attention_plan(self, plan: dict[str, Choice] | None, pin: bool = False) -> None:
        """Run each layer type with the kernel `plan` names (see `attention.plan_attention`).

        `pin=True` keeps this plan until the next call (PretrainTrainer pins the plan its preflight
        reported, so the report is what runs); `plan=None` unpins and lets the next forward re-plan.
        """
        if plan is None:
            self._plan_key = None
            return
        views = {t: config_for_backend(self.config, choice.backend) for t, choice in plan.items()}
        for layer in self.layers:
            layer.self_attn.config = views[layer.layer_type]
        self.attention_plan, self._mask_configs = plan, views
        self._plan_key = "pinned" if pin else None

    def _plan_for(self, inputs_embeds, packed: bool) -> None:
        """(Re)plan the kernels when what they depend on changed: device, dtype, mode, packing, request."""
        if self._plan_key == "pinned":
            return
        device = inputs_embeds.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else inputs_embeds.dtype
        training = self.training and torch.is_grad_enabled()
        key = (device, dtype, training, packed, self.config.attention_backend)
        if key == self._plan_key:
            return
        if torch.compiler.is_compiling():  # detecting kernels cannot be traced: plan outside the graph (a break)
            logger.warning_once(
                "torch.compile: the attention plan is made in a graph break; pin it first (PretrainTrainer does) or "
                "run one eager forward with the same device, dtype, mode and packing."
            )
            return _plan_outside_graph(self, key, packed)
        self._plan(key, packed)

    def _plan(self, key: tuple, packed: bool) -> None:
        device, dtype, training = key[:3]
        env = Environment.detect(device, dtype, training)
        try:
            plan = plan_attention(self.config, env, packed)
        except (
            BackendUnavailableError
        ) as err:  # e.g. a checkpoint saved with attention_backend="flash_attention_2", on a CPU
            logger.warning(f"{err} Falling back to attention_backend='auto' for this forward.")
            plan = plan_attention(self.config, env, packed, requested="auto")
        self.set_attention_plan(plan)
        self._plan_key = key

    def _flash_varlen_kwargs(self, position_ids: torch.Tensor, batch_size: int) -> dict:
        """cu_seqlens for FlashAttention from restarting position ids, any batch size (one pass per forward)."""
        if not any(c.backend in KERNEL_PACKAGES for c in self.attention_plan.values()):
            return {}
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids.expand(batch_size, -1))
        return dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        cache = cache if cache is not None else past_key_values
        # Position ids without a 2D mask or cache: possibly packed documents (restarting positions).
        packed = position_ids is not None and attention_mask is None and cache is None
        if use_cache is None:  # a KV cache only serves generation: none in training or on packed rows unless asked for
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled()) and not packed
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        self._plan_for(inputs_embeds, packed)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)

        masks = build_attention_masks(self._mask_configs, inputs_embeds, attention_mask, cache, position_ids)
        # Packed rows on FlashAttention: transformers derives varlen from position ids only for batch size 1,
        # so hf_pretrain passes cu_seqlens itself to the FA layers.
        varlen = self._flash_varlen_kwargs(position_ids, inputs_embeds.shape[0]) if packed else {}
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states, all_hidden = inputs_embeds, [inputs_embeds] if output_hidden_states else None
        router_logits = []
        for layer in self.layers:
            fa_layer = self.attention_plan[layer.layer_type].backend in KERNEL_PACKAGES
            hidden_states = layer(
                hidden_states,
                position_embeddings,
                masks[layer.layer_type],
                cache=cache,
                position_ids=position_ids,
                **(varlen if fa_layer else {}),
                **kwargs,
            )
            if layer.is_moe:
                hidden_states, logits = hidden_states
                router_logits.append(logits)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden[-1] = hidden_states
        if router_logits:
            return MoeModelOutputWithPast(
                last_hidden_state=hidden_states,
                cache=cache if use_cache else None,
                hidden_states=tuple(all_hidden) if output_hidden_states else None,
                router_logits=tuple(router_logits),
            )
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )


@torch.compiler.disable
def _plan_outside_graph(model: PretrainModel, key: tuple, packed: bool) -> None:
    model._plan(key, packed)


class PretrainForCausalLM(PretrainPreTrainedModel, GenerationMixin):
    """Causal LM head on `PretrainModel`; `lm_head` is untied unless the config ties it."""

    @property
    def attention_plan(self) -> dict[str, Choice] | None:
        """The kernel of each layer type in the last forward (or as set by `set_attention_plan`)."""
        return self.model.attention_plan

    def set_attention_plan(self, plan: dict[str, Choice] | None, pin: bool = False) -> None:
        self.model.set_attention_plan(plan, pin)

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PretrainConfig):
        try:
            super().__init__(config)
            self.model = PretrainModel(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            # MoE: running sums of the routing statistics of training forwards, popped by MoECallback at each log.
            self.moe_metrics = MoEMetrics() if config.num_experts else None
            # MoE under Ulysses SP: a callable giving the group whose ranks hold shards of the same rows, set by
            # training/sequence_parallel.py; training forwards take the router's loss over the whole rows with it.
            self.router_group = None
            self.post_init()
        finally:
            self._end_of_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits and, with `labels`, the loss; in training the loss alone (see `_skips_logits`).

        `skip_logits`: None (default) skips the logits in training forwards with labels when
        `config.chunked_loss`; True computes the loss without logits in any mode (labels required);
        False always returns the logits.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = loss = None
        if self._skips_logits(labels, logits_to_keep, skip_logits):
            loss = causal_lm_loss(hidden_states, self.lm_head.weight, labels, **kwargs)
        else:
            if isinstance(logits_to_keep, int) and logits_to_keep > 0:
                hidden_states = hidden_states[:, -logits_to_keep:]
            elif isinstance(logits_to_keep, torch.Tensor):
                hidden_states = hidden_states[:, logits_to_keep]
            logits = self.lm_head(hidden_states)
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if getattr(outputs, "router_logits", None):
            return self._moe_output(outputs, logits, loss, attention_mask, labels, kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states
        )

    def _skips_logits(self, labels, logits_to_keep, skip_logits: bool | None) -> bool:
        """Whether this forward computes the loss from the hidden states without the logits (`loss.py`).

        Asked for (`skip_logits=True`), or by default in training with labels when `config.chunked_loss`
        is on and nothing asks for logits (`logits_to_keep`). It needs a bare bias-free `nn.Linear` head
        and transformers' own causal-LM loss; otherwise (a PEFT or FSDP wrapper on `lm_head`, a hook on it,
        a custom `loss_function`, a torch without the chunked op) the full logits are computed, with a
        warning that says why.
        """
        if skip_logits is None:
            wanted = self.config.chunked_loss and self.training and labels is not None
            skip_logits = wanted and isinstance(logits_to_keep, int) and logits_to_keep == 0
        elif skip_logits and (labels is None or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)):
            raise ValueError(
                "skip_logits=True computes the loss without logits: pass labels, and no logits_to_keep "
                "(or skip_logits=None/False to get logits)."
            )
        if not skip_logits:
            return False
        reason = self._fused_loss_unavailable()
        if reason:
            logger.warning_once(f"chunked_loss: {reason}; computing the full logits instead.")
        return reason is None

    def _fused_loss_unavailable(self) -> str | None:
        """Why the loss cannot be computed without logits on this model and torch, or None when it can."""
        head = self.lm_head
        if type(head) is not nn.Linear:
            return f"lm_head is a {type(head).__name__}, not a bare nn.Linear"
        if head.bias is not None:
            return "lm_head has a bias"
        zero3 = hasattr(head.weight, "ds_id")  # ZeRO-3 gathers the weight when the forward reads it (loss.py)
        if hasattr(head, "_hf_hook") or (not zero3 and (head._forward_hooks or head._forward_pre_hooks)):
            return "lm_head has forward hooks that a fused loss would bypass"
        if self.loss_function is not ForCausalLMLoss:
            return f"the model's loss_function is {getattr(self.loss_function, '__name__', self.loss_function)}"
        return unavailable_reason(head.weight.device)

    def _moe_output(self, outputs, logits, loss, attention_mask, labels, kwargs) -> PretrainMoeCausalLMOutput:
        """Routing losses and statistics; in training the weighted losses join the LM loss.

        With `num_items_in_batch` (the Trainer's token count over gradient-accumulation micro-batches and
        ranks), the aux terms are weighted by this micro-batch's share of those tokens, the weighting the LM
        loss gets: their sum over micro-batches and ranks is then a token-weighted mean, so
        `router_aux_loss_coef` means the same for any accumulation or world size.
        """
        config, router_logits = self.config, outputs.router_logits
        token_mask = None  # padding left out of losses and load when there is one 2D mask entry per routed token
        if isinstance(attention_mask, torch.Tensor) and attention_mask.numel() == router_logits[0].shape[0]:
            token_mask = attention_mask.reshape(-1).bool()
        training = self.training and torch.is_grad_enabled()  # Ulysses shards rows in training only
        group = self.router_group() if training and self.router_group is not None else None
        stats = routing_statistics(
            router_logits,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.moe_capacity_factor,
            token_mask,
            group,
        )
        if training:
            self.moe_metrics.add(stats)
            if loss is not None:
                aux = config.router_aux_loss_coef * stats.aux_loss + config.router_z_loss_coef * stats.z_loss
                total = kwargs.get("num_items_in_batch")
                if total is not None:
                    shifted = kwargs.get("shift_labels")
                    shifted = labels[..., 1:] if shifted is None else shifted
                    aux = aux * (shifted != -100).sum() / total
                loss = loss + aux.to(loss.device)
        return PretrainMoeCausalLMOutput(
            loss=loss,
            aux_loss=stats.aux_loss,
            z_loss=stats.z_loss,
            expert_load=stats.expert_load,
            dropped_fraction=stats.dropped_fraction,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            router_logits=router_logits,
        )


AutoModelForCausalLM.register(PretrainConfig, PretrainForCausalLM)  # AutoModelForCausalLM.from_pretrained builds it
