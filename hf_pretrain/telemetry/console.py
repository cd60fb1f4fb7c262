"""What a person reads on the console during training: transformers' progress bar or printer, filtered.

A training log carries every metric of the callbacks (24 keys a step on one CPU process: straggler
scores with one rank, RSS, ETA, ...). Printed, the line is unreadable; so `PretrainTrainer` (extras on)
swaps transformers' `ProgressCallback` / `PrinterCallback` for these subclasses during `train()`.
They print, of a training log (one with a `loss`):
- `loss`, `grad_norm`, `learning_rate`, `epoch`;
- `tokens_per_second`, `mfu_spec`, `mfu_measured` (when measured);
- every text value: the warnings of a rule that fired (`straggler_warning`, `underclock_warning`,
  `attention_fallback`, `mfu_*_warning`, `sensors_unavailable`, ...);
- the loss guard's counters (`loss_guard_*`), logged only once something happened.
Other logs (evaluation, the end of training) are printed whole. Only the printed line is filtered:
the full log still reaches `telemetry.jsonl`, `report_to` and `state.log_history` as before.
"""

from __future__ import annotations

from transformers.trainer_callback import PrinterCallback, ProgressCallback

PRINTED = ("loss", "grad_norm", "learning_rate", "tokens_per_second", "mfu_spec", "mfu_measured", "epoch")


def printed(logs: dict) -> dict:
    """The keys of `logs` a person reads (module docstring); a log without a `loss` whole."""
    if "loss" not in logs:
        return logs
    return {k: v for k, v in logs.items() if k in PRINTED or isinstance(v, str) or k.startswith("loss_guard_")}


class ConsoleProgressCallback(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=printed(logs or {}), **kwargs)


class ConsolePrinterCallback(PrinterCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.pop("total_flos", None)  # as PrinterCallback does, for the callbacks after it
        return super().on_log(args, state, control, logs=printed(logs or {}), **kwargs)


CONSOLE = {ProgressCallback: ConsoleProgressCallback, PrinterCallback: ConsolePrinterCallback}


def swap_console(handler) -> list[tuple[int, object]]:
    """Put the filtered console callbacks in place of transformers' own in `handler.callbacks` (same position);
    returns what was replaced, for `restore_console`."""
    replaced = []
    for index, callback in enumerate(handler.callbacks):
        console = CONSOLE.get(type(callback))  # exactly transformers' class: a user's subclass stays
        if console is not None:
            replaced.append((index, callback))
            ours = console()
            if isinstance(callback, ProgressCallback):  # a warning is the line's point: not cut at 100 characters
                ours.max_str_len = max(callback.max_str_len, 2000)
            handler.callbacks[index] = ours
    return replaced


def restore_console(handler, replaced: list[tuple[int, object]]) -> None:
    for index, callback in replaced:
        if index < len(handler.callbacks) and type(handler.callbacks[index]) in CONSOLE.values():
            handler.callbacks[index] = callback
