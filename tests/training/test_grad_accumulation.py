"""Gradient accumulation over micro-batches with different real-token counts equals one big batch."""

import torch
from transformers import TrainerCallback, default_data_collator

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset


class GradCapture(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = [p.grad.detach().clone() for p in self.model.parameters()]


def first_step_grads(tmp_path, batch, accumulation):
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config())
    args = quick_args(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=0.0,
        measure_peak_tflops=False,
        seed=5,
        telemetry=False,
    )
    capture = GradCapture(model)
    trainer = PretrainTrainer(
        model=model, args=args, train_dataset=dataset(), data_collator=default_data_collator, callbacks=[capture]
    )
    trainer.train()
    return capture.grads


def test_four_micro_batches_equal_one_batch_four_times_larger(tmp_path):
    data = dataset()
    real = [sum(1 for label in row if label != -100) for row in data["labels"]]
    assert len(set(real)) > 1  # rows do carry different numbers of real (trained) tokens
    big = first_step_grads(tmp_path / "big", batch=8, accumulation=1)
    accumulated = first_step_grads(tmp_path / "acc", batch=2, accumulation=4)
    for g_big, g_acc in zip(big, accumulated):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-4, atol=1e-6)
