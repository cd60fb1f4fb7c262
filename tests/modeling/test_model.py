import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_pretrain import PretrainForCausalLM
from tests.conftest import small_config

BACKENDS = ["sdpa", "eager"]


def build(seed=0, attn="sdpa", **overrides) -> PretrainForCausalLM:
    torch.manual_seed(seed)
    config = small_config(**overrides)
    config.attention_backend = attn
    return PretrainForCausalLM(config).eval()


def test_parameter_names_are_llamas():
    ours = build()
    llama = LlamaForCausalLM(ours.config)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in llama.named_parameters()]
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("attn", BACKENDS)
def test_checkpoint_loads_in_plain_llama_with_same_logits(tmp_path, attn):
    model = build(attn=attn)
    model.save_pretrained(tmp_path)
    assert '"model_type": "hf_pretrain"' in (tmp_path / "config.json").read_text()
    llama = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=attn).eval()
    ids = torch.randint(0, 128, (2, 48))
    with torch.no_grad():
        diff = (model(ids).logits - llama(ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_auto_model_round_trip(tmp_path):
    model = build(window_pattern="SL", sliding_window=8)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is PretrainForCausalLM
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def changed_positions(model, ids, position):
    """Per layer output, the positions whose hidden state changes when token `position` changes."""
    other = ids.clone()
    other[0, position] = (ids[0, position] + 1) % model.config.vocab_size
    with torch.no_grad():
        a = model(ids, output_hidden_states=True).hidden_states
        b = model(other, output_hidden_states=True).hidden_states
    return [set((x - y).abs().amax(-1)[0].nonzero().flatten().tolist()) for x, y in zip(a[1:], b[1:])]


@pytest.mark.parametrize("attn", BACKENDS)
def test_sliding_window_hides_tokens_outside_the_window(attn):
    window, pos, seq = 6, 5, 64
    model = build(attn=attn, window_pattern="SSSL", sliding_window=window)
    changed = changed_positions(model, torch.randint(0, 128, (1, seq)), pos)
    for depth, positions in enumerate(changed[:3], start=1):
        # After `depth` window layers the perturbation reaches at most depth * (window - 1) tokens further.
        assert positions == set(range(pos, min(seq, pos + depth * (window - 1) + 1))), depth
    assert changed[3] == set(range(pos, seq)), "the full (L) layer must see the token from everywhere after it"


@pytest.mark.parametrize("attn", BACKENDS)
def test_full_attention_layers_see_everything_before(attn):
    model = build(attn=attn, window_pattern="L")
    changed = changed_positions(model, torch.randint(0, 128, (1, 40)), 2)
    assert all(positions == set(range(2, 40)) for positions in changed)


def test_plain_llama_ignores_the_window_and_we_do_not():
    ours = build(window_pattern="SL", sliding_window=4, num_hidden_layers=2)
    llama = LlamaForCausalLM(ours.config).eval()
    llama.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 128, (1, 32))
    with torch.no_grad():
        assert (ours(ids).logits - llama(ids).logits).abs().max() > 1e-3
        # Inside the first window both see the same keys.
        torch.testing.assert_close(ours(ids[:, :4]).logits, llama(ids[:, :4]).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pattern", ["L", "SSSL"])
def test_cached_generation_matches_uncached(pattern):
    model = build(window_pattern=pattern, sliding_window=5)
    prompt = torch.randint(0, 128, (2, 7))
    cached = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    uncached = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20, use_cache=False)
    assert cached.shape == (2, 27)
    torch.testing.assert_close(cached, uncached)


def test_loss_and_gradient_checkpointing_gradients_match():
    model = build(window_pattern="SL", sliding_window=8).train()
    ids = torch.randint(0, 128, (2, 32))
    loss = model(ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.gradient_checkpointing_enable()
    loss_ckpt = model(ids, labels=ids).loss
    grads_ckpt = torch.autograd.grad(loss_ckpt, list(model.parameters()))
    assert abs(loss.item() - loss_ckpt.item()) < 1e-6 and loss.item() > 0
    for g, h in zip(grads, grads_ckpt):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)


def test_unknown_attention_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='no_such_kernel' is invalid"):
        small_config(attention_backend="no_such_kernel")
    with pytest.raises(ValueError, match="no_such_kernel"):
        build(attn="no_such_kernel")(torch.randint(0, 128, (1, 8)))


def test_transformers_attn_implementation_sets_the_backend_also_when_a_config_is_reused(tmp_path):
    config = small_config()
    PretrainForCausalLM(config)  # a first model built from the config
    assert PretrainForCausalLM._from_config(config, attn_implementation="eager").config.attention_backend == "eager"
    model = build()
    model.save_pretrained(tmp_path)
    assert PretrainForCausalLM.from_pretrained(tmp_path).config.attention_backend == "sdpa"  # saved by build()
    auto = PretrainForCausalLM.from_pretrained(tmp_path, attn_implementation="auto")
    assert auto.config.attention_backend == "auto"


def test_a_saved_backend_that_cannot_run_here_falls_back_to_auto(tmp_path):
    model = build(attn="flash_attention_2")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8)))  # no GPU here: warned, then auto
    assert {c.backend for c in model.attention_plan.values()} == {"sdpa"}
