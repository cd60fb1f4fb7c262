"""The rehearsal's checklist: each check reads the runs' results and the ranks' records, and says passed or failed
with the reason and the fix (or "not run", with why, when an earlier run it needs did not happen).

Records are what `probe.py` wrote per rank: `micro_batches[step]` (the sample ids of every micro-batch
the rank trained at that optimizer step: a dataset row, or under Ulysses SP `[row, part]`), `losses[step]`,
`start_step`, and on rank 0 `order` when the sampler can tell its order. Data sharding reads them by group: the
ranks of one TP group (AutoTP) or SP group must train the same rows, the data-parallel groups disjoint ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .launch import RunResult, Topology

# Absolute, per rank and step. On a CPU a resume gives every loss bit for bit (the tests require 0, the check
# prints the largest gap); on GPUs nondeterministic reductions may move the last bits.
LOSS_TOLERANCE = 1e-5


@dataclass
class Check:
    name: str
    status: str  # "passed", "failed" or "not run"
    detail: str
    fix: str = ""


def _not_run(name: str, why: str) -> Check:
    return Check(name, "not run", why)


def _failed_run(run: RunResult) -> str:
    why = run.hung or f"exit codes {run.returncodes}"
    error = run.error()
    return f"the {run.name} run failed ({why}){': ' + error if error else ''}; log: {run.log}"


def rendezvous(run: RunResult, topology: Topology) -> Check:
    name, expected = "rendezvous", topology.processes
    records = run.records
    if len(records) < expected or any(r["world_size"] != expected for r in records):
        seen = sorted(r["rank"] for r in records)
        return Check(
            name,
            "failed",
            f"{len(records)} of {expected} ranks reached training (ranks {seen}); {_failed_run(run)}",
            "run `accelerate launch --config_file <the rehearsal config> -m hf_pretrain.cli doctor --distributed` "
            "for the rendezvous address, port and versions of every rank",
        )
    nodes = len({r["node"] for r in records})
    if nodes != topology.nodes:
        return Check(name, "failed", f"the ranks ran on {nodes} node(s), the config asks for {topology.nodes}", "")
    first = min(r["begin_time"] for r in records)
    return Check(
        name,
        "passed",
        f"{expected} ranks on {nodes} node(s) joined {records[0]['master']} ({records[0]['backend']}); "
        f"training began {max(r['begin_time'] for r in records) - first:.1f} s apart",
    )


def _steps(records: list[dict], first: int = 1) -> dict[int, dict[int, list]]:
    """step -> rank -> sample ids trained (all micro-batches)."""
    out: dict[int, dict[int, list]] = {}
    for record in records:
        for step, micro in record["micro_batches"].items():
            if int(step) >= first:
                out.setdefault(int(step), {})[record["rank"]] = [i for batch in micro for i in batch]
    return out


def _row(sample) -> int | str:
    """A sample's dataset row: its index (or fingerprint), or the row of an SP part `[row, part]`."""
    return sample[0] if isinstance(sample, list) else sample


def _part(sample) -> int | None:
    """The part of its row an SP rank trained (None: the whole row)."""
    return sample[1] if isinstance(sample, list) else None


def _group_kind(topology: Topology) -> str:
    return " x ".join(k for k, n in (("TP", topology.tp), ("SP", topology.sp)) if n > 1)


def _group_fault(step: int, members: dict[int, list], ranks: range, topology: Topology) -> str | None:
    """Why the ranks of one TP / SP group did not train the same rows at `step` (SP: each its own part), or None."""
    rows = {rank: [_row(s) for s in members.get(rank, [])] for rank in ranks}
    first, kind = ranks[0], _group_kind(topology)
    for rank in ranks[1:]:
        if rows[rank] != rows[first]:
            return (
                f"at step {step} rank {first} trained rows {rows[first][:4]} and rank {rank} rows {rows[rank][:4]}: "
                f"the ranks of one {kind} group must train the same rows"
            )
    for rank in ranks if topology.sp > 1 else ():
        expected = (rank - first) % topology.sp  # DeepSpeed's SP rank: consecutive ranks
        parts = {_part(s) for s in members.get(rank, [])}
        if parts != {expected}:
            got = "whole rows" if None in parts else f"parts {sorted(parts)}"
            return (
                f"at step {step} rank {rank} trained {got} of rows {rows[first][:4]}, not part {expected} of "
                f"{topology.sp} of each: the ranks of an SP group must each train their part of the sequence"
            )
    return None


GROUP_FIX = {
    "TP": "let accelerate prepare the train DataLoader: under AutoTP it gives the ranks of a TP group the same batch "
    "(data rank = process index // autotp_size); a loader sharded over every rank splits the group",
    "SP": "let the Trainer wrap the train DataLoader under the parallelism_config's sp_size (DeepSpeed's "
    "UlyssesSPDataLoaderAdapter gives the SP group one batch and each rank its part of every row)",
}


def _group_rows(steps: dict[int, dict[int, list]], topology: Topology) -> dict[int, dict[int, list]] | Check:
    """step -> data-parallel group -> the rows it trained; or the failed check when a TP / SP group's ranks did not
    train the same rows. Without TP or SP every rank is a group of its own."""
    size, out = topology.group_size, {}
    for step in sorted(steps):
        for group in range(topology.processes // size):
            ranks = range(group * size, (group + 1) * size)
            fault = _group_fault(step, steps[step], ranks, topology) if size > 1 else None
            if fault:
                kind = "SP" if topology.tp == 1 else "TP"
                return Check("data sharding", "failed", fault, GROUP_FIX[kind])
            out.setdefault(step, {})[group] = [_row(s) for s in steps[step].get(ranks[0], [])]
    return out


DEEPSPEED_TP_CHECK = "Data inconsistency within the TP group"  # DeepSpeed's check of the first forward's inputs


def _untrained(run: RunResult) -> Check:
    """No rank trained a step: DeepSpeed's own TP check stopped a loader that splits a TP group, or something else."""
    log = run.log.read_text(errors="replace") if run.log.exists() else ""
    if DEEPSPEED_TP_CHECK in log:
        return Check(
            "data sharding",
            "failed",
            f"DeepSpeed stopped the run at its first forward ({DEEPSPEED_TP_CHECK}): the ranks of a TP group were "
            "given different rows",
            GROUP_FIX["TP"],
        )
    return _not_run("data sharding", f"no rank trained a step; {_failed_run(run)}")


def _who(group: int, topology: Topology) -> str:
    size = topology.group_size
    if size == 1:
        return f"rank {group}"
    return f"data-parallel group {group} (ranks {group * size}-{(group + 1) * size - 1})"


def data_sharding(run: RunResult, topology: Topology) -> Check:
    """Within the first epoch: the ranks of a TP / SP group train the same rows (SP: each its part), the
    data-parallel groups train disjoint rows, a full global batch a step, and none of the sampler's order skipped."""
    name = "data sharding"
    if len(run.records) < topology.processes:
        return _not_run(name, "the ranks did not all train")
    rows = run.records[0].get("dataset_rows")
    if topology.sp > 1 and rows is None:
        return _not_run(
            name,
            "the SP ranks' parts of the sequence are matched to rows of the training dataset, which the probe could "
            "not index (no input_ids column, or over 2M rows); rehearse with a --dataset-path of fewer rows",
        )
    per_rank = _steps(run.records)
    if not per_rank:
        return _untrained(run)
    steps = _group_rows(per_rank, topology)
    if isinstance(steps, Check):
        return steps
    per_global_batch = run.records[0]["global_batch"] // topology.group_size
    where: dict = {}
    counts: Counter = Counter()
    for step in sorted(steps):
        for group, ids in steps[step].items():
            for sample in ids:
                counts[sample] += 1
                where.setdefault(sample, []).append((step, group))
    trained = sum(counts.values())
    readers = "ranks" if topology.group_size == 1 else "data-parallel groups"
    if rows is None or trained <= rows:  # within one epoch, a sample trained twice is a sharding fault
        repeated = [s for s, n in counts.items() if n > 1]
        if repeated:
            first = repeated[0]
            places = ", ".join(f"{_who(g, topology)} at step {s}" for s, g in where[first][:4])
            return Check(
                name,
                "failed",
                f"{len(repeated)} of {len(counts)} samples were trained more than once within the first epoch; "
                f"sample {first}: {places}. The {readers} read the same data.",
                "let the Trainer build the train DataLoader (get_train_dataloader prepares it with accelerate, which "
                "shards it per rank), or shard it yourself (DistributedSampler, datasets.distributed.split_dataset_by_node)",
            )
    short = [s for s in steps if sum(len(ids) for ids in steps[s].values()) != per_global_batch]
    if short:
        return Check(
            name,
            "failed",
            f"step {short[0]} trained {sum(len(i) for i in steps[short[0]].values())} samples, not the global batch of "
            f"{per_global_batch} (per-device batch x processes x accumulation{_per_group(topology)})",
            "check the data loader's batch size and drop_last; every rank must train a full micro-batch",
        )
    order = run.records[0].get("order")
    coverage = "order of the sampler not known: coverage not checked"
    if order and len(order) >= trained:
        expected = set(order[:trained])
        missed = sorted(expected - set(counts))
        if missed:
            return Check(
                name,
                "failed",
                f"{len(missed)} samples of the first {trained} of the sampler's order were trained by no rank "
                f"(e.g. {missed[:5]}): samples are skipped",
                "shard the data once: either the Trainer's data loader (accelerate) or your own sharding, not both",
            )
        coverage = f"exactly the first {trained} samples of the sampler's order ({run.records[0]['sampler']})"
    ranks = len({r for s in per_rank.values() for r in s})
    return Check(
        name,
        "passed",
        f"{trained} samples over {len(steps)} steps on {ranks} ranks{_grouped(topology)}, "
        f"none trained twice, none skipped: {coverage}",
    )


def _per_group(topology: Topology) -> str:
    return f" / {_group_kind(topology)} {topology.group_size}" if topology.group_size > 1 else ""


def _grouped(topology: Topology) -> str:
    """', in 1 data-parallel group of TP 2: each TP group trained the same rows' (nothing without TP or SP)."""
    if topology.group_size == 1:
        return ""
    groups, kind = topology.processes // topology.group_size, _group_kind(topology)
    parts = ", each rank its part of the sequence" if topology.sp > 1 else ""
    return (
        f" in {groups} data-parallel group{'s' if groups > 1 else ''} of {kind} {topology.group_size}: "
        f"each {kind} group trained the same rows{parts}"
    )


def checkpoint(killed: RunResult, topology: Topology, save_steps: int) -> Check:
    from ..training.resume.check import check_checkpoint, checkpoints_newest_first

    name = "checkpoint"
    run_dir = killed.log.parent / "run"
    if killed.killed is None:
        return _not_run(name, f"the run that is killed did not reach its kill step; {_failed_run(killed)}")
    expected = [f"checkpoint-{s}" for s in range(save_steps, killed.killed["step"], save_steps)]
    found = checkpoints_newest_first(run_dir)
    names = sorted((p.name for p in found), key=lambda n: int(n.split("-")[1]))
    in_flight = ""
    if expected and names == expected[:-1] and (run_dir / ".saving" / expected[-1]).is_dir():
        in_flight = (  # an asynchronous save still being written: the kill leaves the one before as the newest
            f" ({expected[-1]} was still being written in the background at the kill: never renamed into place, "
            f"so a resume takes {names[-1] if names else 'step 0'})"
        )
        expected = expected[:-1]
    if names != expected or not found:
        return Check(
            name,
            "failed",
            f"checkpoints before the kill at step {killed.killed['step']}: {names or 'none'}, expected {expected}",
            "save with --save_strategy steps --save_steps N on every rank (trainer.save_model / Trainer checkpoints)",
        )
    deepspeed, fsdp = topology.deepspeed_file is not None, topology.config.get("distributed_type") == "FSDP"
    result = check_checkpoint(found[0], topology.processes, deepspeed=deepspeed, fsdp=fsdp)
    if not result.ok:
        return Check(name, "failed", f"{found[0].name} cannot be resumed: {'; '.join(result.problems)}", "")
    return Check(name, "passed", f"{', '.join(names)} written; {found[0].name} complete and readable{in_flight}")


def kill_and_teardown(killed: RunResult) -> Check:
    name = "kill -9 and teardown"
    if killed.killed is None:
        return _not_run(name, f"no rank reached the kill step; {_failed_run(killed)}")
    where = f"rank {killed.killed['rank']} killed (SIGKILL) in step {killed.killed['step']}"
    if killed.hung:
        return Check(
            name,
            "failed",
            f"{where}; {killed.hung}: the other ranks stayed blocked",
            "set a collective timeout the launcher can act on (NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and "
            "PretrainingArguments(ddp_timeout=...)); torchrun tears down a node's workers when one exits",
        )
    if all(code == 0 for code in killed.returncodes):
        return Check(name, "failed", f"{where}, yet the launch exited 0: a lost rank would go unnoticed", "")
    return Check(
        name, "passed", f"{where}; the launch tore down in {killed.teardown_s:.1f} s, exit codes {killed.returncodes}"
    )


def resume(straight: RunResult, resumed: RunResult | None, start: int | None) -> Check:
    name = "resume exactness"
    if resumed is None or start is None:
        return _not_run(name, "no checkpoint to resume from")
    if not straight.ok or not straight.records:
        return _not_run(name, f"no uninterrupted run to compare with; {_failed_run(straight)}")
    if not resumed.ok:
        return Check(name, "failed", _failed_run(resumed), "")
    before, after = _steps(straight.records, start + 1), _steps(resumed.records, start + 1)
    if sorted(after) != sorted(before):
        return Check(
            name, "failed", f"resumed from step {start} it trained steps {sorted(after)}, not {sorted(before)}", ""
        )
    for step in sorted(after):
        if after[step] != before[step]:
            rank = next(r for r in after[step] if after[step][r] != before[step].get(r))
            return Check(
                name,
                "failed",
                f"data position: at step {step} rank {rank} trained samples {after[step][rank][:4]}..., the uninterrupted "
                f"run {before[step][rank][:4]}...: the resumed run does not continue where the checkpoint stopped",
                "resume the data with the checkpoint: leave ignore_data_skip off and let the Trainer build the data "
                "loader (PretrainTrainer saves the position in hf_pretrain_state.json); a stream needs its state_dict",
            )
    losses = {(r["rank"], s): v for r in straight.records for s, v in r["losses"].items()}
    worst, where = 0.0, None
    for record in resumed.records:
        for step, value in record["losses"].items():
            gap = abs(value - losses.get((record["rank"], step), float("inf")))
            if gap > worst:
                worst, where = gap, (record["rank"], step)
    if worst > LOSS_TOLERANCE:
        return Check(
            name,
            "failed",
            f"same samples, other losses: rank {where[0]} step {where[1]} differs by {worst:.2e} from the uninterrupted run",
            "the checkpoint does not restore the model / optimizer / scheduler / RNG state exactly",
        )
    return Check(
        name,
        "passed",
        f"resumed at step {start}: steps {min(after)}-{max(after)} trained the same samples with the same losses "
        f"(max |difference| {worst:.1e})",
    )


RESTART_FIX = (
    "let the launcher restart failed runs (accelerate launch --max_restarts N --rdzv_backend c10d, with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment) and resume by itself: --resume_from_checkpoint auto "
    "(PretrainTrainer: the newest whole checkpoint, or a fresh start)"
)


def _recovered(name: str, straight: RunResult, run: RunResult, kill_at: int, what: str) -> Check | str:
    """The failed check, or the sentence saying how the run came back."""
    if run.fault is None:
        return _not_run(name, f"no rank reached step {kill_at}; {_failed_run(run)}")
    if not run.ok or run.attempts < 2:
        why = "the launcher did not restart the run" if run.attempts < 2 else "the restarted run failed"
        return Check(name, "failed", f"{what}; {why}: {_failed_run(run)}", RESTART_FIX)
    start = min(r["start_step"] for r in run.records)
    if start == 0:
        return Check(name, "failed", f"{what}; the restarted run started again at step 0", RESTART_FIX)
    exact = resume(straight, run, start)
    if exact.status != "passed":
        return Check(name, exact.status, f"{what}; restarted, then: {exact.detail}", exact.fix)
    return f"{what}; the launcher restarted the run, which resumed by itself: {exact.detail}"


def unattended_recovery(straight: RunResult, restarted: RunResult, kill_at: int) -> Check:
    name = "kill -9, unattended restart"
    what = f"rank {(restarted.fault or {}).get('rank', '?')} killed (SIGKILL) in step {kill_at}, restarts allowed"
    outcome = _recovered(name, straight, restarted, kill_at, what)
    return outcome if isinstance(outcome, Check) else Check(name, "passed", outcome)


def hang_recovery(straight: RunResult, hung: RunResult, kill_at: int) -> Check:
    from ..training.recovery.attempts import read_attempts

    name = "hung rank, watchdog restart"
    what = f"rank {(hung.fault or {}).get('rank', '?')} stopped (SIGSTOP) in step {kill_at}"
    run_dir = hung.log.parent / "run"
    attempts = read_attempts(run_dir)
    first = attempts[0].ended or "" if attempts else ""
    if hung.fault is not None and not first.startswith("hang:"):
        return Check(
            name,
            "failed",
            f"{what}; nothing noticed the hang ({hung.hung or _failed_run(hung)})",
            "train with PretrainTrainer: its hang watchdog (hang_watchdog, hang_timeout_factor / _min_s / _floor_s) "
            "dumps the stacks and exits so the launcher restarts; " + RESTART_FIX,
        )
    outcome = _recovered(name, straight, hung, kill_at, what)
    if isinstance(outcome, Check):
        return outcome
    stacks = sorted(p.name for p in (run_dir / "recovery").glob("stacks-rank*.txt"))
    stopped = (hung.fault or {}).get("rank")
    named = f"rank {stopped} (" in first and "stopped reporting" in first
    said = "named the stopped rank" if named else f"fired but did not name rank {stopped} as the one that stopped"
    fix = (
        ""
        if named
        else "put output_dir on a file system every node shares: the ranks read each other's heartbeats there"
    )
    return Check(
        name, "passed", f"the watchdog {said} and dumped {', '.join(stacks)}; " + outcome.split("; ", 1)[1], fix
    )


PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.arange(3, 35).reshape(2, 16) % model.config.vocab_size
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
print(type(model).__name__)
"""


def _no_weights_reason(run_dir: Path, topology: Topology) -> tuple[str, str]:
    if topology.deepspeed_file is not None:
        zero = json.loads(topology.deepspeed_file.read_text()).get("zero_optimization", {})
        if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save", False):
            return (
                f"ZeRO-3 saved only its partitioned shards in {run_dir} "
                f"(stage3_gather_16bit_weights_on_model_save is false in {topology.deepspeed_file})",
                f'set "stage3_gather_16bit_weights_on_model_save": true in {topology.deepspeed_file}, '
                "or consolidate afterwards with zero_to_fp32.py",
            )
    fsdp = topology.config.get("fsdp_config") or {}
    if fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        return (
            f"FSDP saved sharded weights in {run_dir} (fsdp_state_dict_type {fsdp['fsdp_state_dict_type']})",
            "set fsdp_state_dict_type: FULL_STATE_DICT for the final save, or merge with `accelerate merge-weights`",
        )
    return (
        f"no model weights in {run_dir}",
        "save the final model with trainer.save_model(args.output_dir) on every rank",
    )


def consolidated_save(straight: RunResult, topology: Topology, out: Path) -> Check:
    import torch

    from ..modeling.export import export_hf
    from ..modeling.model import PretrainForCausalLM

    name = "consolidated save + export"
    run_dir = straight.log.parent / "run"
    if not straight.records or not all(r["finished"] for r in straight.records):
        return _not_run(name, f"the uninterrupted run did not finish training; {_failed_run(straight)}")
    if not any((run_dir / f).exists() for f in ("model.safetensors", "model.safetensors.index.json")):
        reason, fix = _no_weights_reason(run_dir, topology)
        return Check(name, "failed", reason, fix)
    try:
        saved = PretrainForCausalLM.from_pretrained(run_dir).eval()
        exported = export_hf(saved, out / "export")
    except Exception as err:  # noqa: BLE001 - any failure of the load is the finding
        return Check(name, "failed", f"the save in {run_dir} does not load: {type(err).__name__}: {err}", "")
    logits_file = out / "export" / "probe_logits.pt"
    plain = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(exported), str(logits_file)], capture_output=True, text=True
    )
    if plain.returncode != 0:
        error = (plain.stderr.strip().splitlines() or ["?"])[-1]
        return Check(name, "failed", f"plain transformers cannot load the export in {exported}: {error}", "")
    ids = torch.arange(3, 35).reshape(2, 16) % saved.config.vocab_size
    with torch.no_grad():
        gap = (saved(input_ids=ids).logits - torch.load(logits_file)).abs().max().item()
    logits_file.unlink()
    if gap > 1e-4:
        return Check(name, "failed", f"the export's logits differ from the saved model's by {gap:.2e}", "")
    return Check(
        name,
        "passed",
        f"{run_dir} -> export_hf -> AutoModelForCausalLM ({plain.stdout.strip()}), logits equal (max |difference| {gap:.1e})",
    )
