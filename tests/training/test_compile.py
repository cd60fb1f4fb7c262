"""torch.compile of PretrainForCausalLM: no graph breaks, compiled == eager (losses and gradients) with sliding
windows, packed documents and MoE, for the whole model and per block, and under PretrainTrainer.

The equality tests use Dynamo with the `aot_eager` backend: it runs the traced forward and the AOT-autograd
backward that Inductor would lower, so a wrong trace (a guard, a dropped side effect, a wrong backward) fails
here in seconds; Inductor's own code generation is exercised per block here and for the whole model in `make test-all`.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.training.compile import compile_blocks, decoder_blocks, prepare_compile
from tests.conftest import quick_args, small_config

VARIANTS = {
    "dense": {},
    "windows": dict(window_pattern="SL", sliding_window=8),
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}
MOE_WINDOWS = dict(
    window_pattern="SL", sliding_window=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
)


def batch(packed: bool) -> dict:
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=ids, labels=ids)
    if packed:  # two documents per row: position ids restart at 20
        inputs["position_ids"] = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0).expand(2, -1)
    return inputs


def model_for(**overrides) -> PretrainForCausalLM:
    torch.manual_seed(0)
    return PretrainForCausalLM(small_config(num_hidden_layers=2, **overrides)).train()


def loss_and_grads(model, module, inputs):
    loss = module(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def assert_close(eager, compiled):
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


EXHAUSTIVE = pytest.mark.exhaustive  # the whole matrix and whole-model Inductor compiles: make test-all
NO_BREAK_CASES = [
    pytest.param(variant, packed, id=f"{variant}-{'packed' if packed else 'rows'}", marks=() if packed else EXHAUSTIVE)
    for variant in VARIANTS
    for packed in (False, True)
]


@pytest.mark.parametrize("variant, packed", NO_BREAK_CASES)
def test_forward_has_no_graph_break(variant, packed):
    model = model_for(**VARIANTS[variant])
    prepare_compile(model)
    inputs = batch(packed)
    model(**inputs)  # plans the attention kernels (outside any graph)
    explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_planning_inside_a_trace_breaks_the_graph_once_then_never():
    model = model_for()  # no eager forward first: the plan is made in a graph break
    assert torch._dynamo.explain(model)(**batch(False)).graph_break_count > 0
    assert model.attention_plan is not None
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(**batch(False)).graph_break_count == 0  # planned: the trace is whole


EQUALITY_CASES = [pytest.param(MOE_WINDOWS, True, "blocks", id="moe-windows-packed-blocks")] + [
    pytest.param(VARIANTS[v], packed, scope, id=f"{v}-{'packed' if packed else 'rows'}-{scope}", marks=EXHAUSTIVE)
    for v in VARIANTS
    for packed in (False, True)
    for scope in ("model", "blocks")
]


@pytest.mark.parametrize("overrides, packed, scope", EQUALITY_CASES)
def test_compiled_losses_and_gradients_equal_eager(overrides, packed, scope):
    model = model_for(**overrides)
    inputs = batch(packed)
    eager = loss_and_grads(model, model, inputs)
    if scope == "blocks":
        assert compile_blocks(model, backend="aot_eager") == 2
        compiled_module = model
    else:
        prepare_compile(model)
        compiled_module = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # the second step runs the cached graph
        assert_close(eager, loss_and_grads(model, compiled_module, inputs))
    assert sum(counters["graph_break"].values()) == 0


def test_whole_model_compile_does_not_recompile_every_step():
    model = model_for(**MOE_WINDOWS)  # MoE metrics are updated in the forward: a counter must not be a constant
    prepare_compile(model)
    compiled = torch.compile(model, backend="aot_eager")
    inputs = batch(True)
    graphs = []
    for _ in range(4):
        loss_and_grads(model, compiled, inputs)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs  # at most the first step and the first step after a fresh start
    assert model.moe_metrics.forwards == 4


def test_blocks_share_one_graph_per_kind_of_block():
    model = PretrainForCausalLM(small_config(num_hidden_layers=6)).train()
    compile_blocks(model, backend="aot_eager")
    model(**batch(False)).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1  # six identical blocks, one trace
    assert all(type(b).__name__ == "PretrainDecoderLayer" for b in decoder_blocks(model))


def test_compile_blocks_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="torch_compile_scope='model'"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_invalid_scope_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="torch_compile_scope='layers' is invalid"):
        PretrainingArguments(output_dir=str(tmp_path), torch_compile_scope="layers")


def train_losses(tmp_path, **args) -> tuple[PretrainTrainer, list[float]]:
    from datasets import Dataset

    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = model_for(**MOE_WINDOWS)
    arguments = quick_args(tmp_path, max_steps=5, per_device_train_batch_size=4, learning_rate=1e-3, seed=7, **args)
    trainer = PretrainTrainer(model=model, args=arguments, train_dataset=data)
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("scope", [pytest.param("model", marks=EXHAUSTIVE), "blocks"])
def test_trainer_compiled_run_matches_eager_and_reports_compile_time(tmp_path, scope, capsys):
    _, eager = train_losses(tmp_path / "eager")
    trainer, compiled = train_losses(
        tmp_path / scope, torch_compile=True, torch_compile_backend="aot_eager", torch_compile_scope=scope
    )
    assert compiled == pytest.approx(eager, rel=1e-4)
    report = trainer._compile_callback.report
    assert report["compile_graph_breaks"] == 0 and report["compile_graphs"] >= 1 and report["compile_time_s"] >= 0
    assert f"compile: scope={scope} backend=aot_eager" in capsys.readouterr().out
    blocks = decoder_blocks(trainer.model)
    assert all((b._compiled_call_impl is not None) == (scope == "blocks") for b in blocks)
    assert type(trainer.model.lm_head) is torch.nn.Linear  # the chunked loss keeps its bare head


@pytest.mark.parametrize("scope", [pytest.param("model", marks=EXHAUSTIVE), "blocks"])
def test_inductor_matches_eager_with_windows_packing_and_moe(scope):
    model = model_for(**MOE_WINDOWS)
    inputs = batch(True)
    eager = loss_and_grads(model, model, inputs)
    if scope == "blocks":
        compile_blocks(model)
        compiled_module = model
    else:
        prepare_compile(model)
        compiled_module = torch.compile(model)
    assert_close(eager, loss_and_grads(model, compiled_module, inputs))
