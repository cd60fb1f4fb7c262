import json

import pytest

from hf_pretrain.cli import main as cli
from hf_pretrain.report import render_report
from hf_pretrain.report.dashboard import episodes, series, warnings_of
from hf_pretrain.report.goodput import goodput_summary


def write_run(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def two_node_records():
    records = []
    for step in range(10, 110, 10):
        stuck = step >= 50
        records.append(
            {
                "step": step,
                "loss": 8 - step / 50,
                "tokens_per_second": 9000 if not stuck else 5000,
                "mfu_spec": 0.2,
                "mfu_measured": 0.25,
                "rank0_sm_clock_mhz": 2190,
                "rank1_sm_clock_mhz": 600 if stuck else 2190,
                "rank0_power_w": 80,
                "rank1_power_w": 30 if stuck else 80,
                "rank0_wait_s": 3.3 if stuck else 0.1,
                "rank1_wait_s": 0.0,
                "rank0_compute_s": 3.9,
                "rank1_compute_s": 7.2 if stuck else 3.9,
            }
        )
    for record in records[4:]:  # a persistent straggler: one episode, not ten lines
        record["straggler_warning"] = (
            "rank 1 (node-b) 1.8x slower, SM 600/2190 MHz, no throttle flag; rank 0 waits 3.3 s of 7.2 s"
        )
    records[6]["underclock_warning"] = (
        "rank 1 (node-b): SM clock 600/2520 MHz (24%) under load, no throttle reason set."
    )
    records[-1]["loss"] = "nan"  # a NaN loss as the JSONL stream writes it
    return records


def test_report_draws_per_rank_series_and_marks_warnings(tmp_path):
    write_run(tmp_path, two_node_records())
    png, page = render_report(tmp_path)
    assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "rank 1 (node-b) 1.8x slower" in text and "data:image/png;base64," in text
    assert text.count("straggler_warning") == 1 and "steps 50-100" in text and "underclock_warning" in text
    clocks = series(two_node_records(), r"^rank\d+_sm_clock_mhz$")
    assert clocks["rank1_sm_clock_mhz"][1][-1] == 600 and len(clocks["rank0_sm_clock_mhz"][0]) == 10
    assert warnings_of(two_node_records())[0][:2] == (50, "straggler_warning")
    assert [e[:3] for e in episodes(two_node_records())] == [
        (50, 100, "straggler_warning"),
        (70, 70, "underclock_warning"),
    ]


def test_report_cli_and_missing_stream(tmp_path, capsys):
    write_run(tmp_path / "run", [{"step": 1, "loss": 2.0, "process_rss_gib": 0.5}])
    assert cli(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.png").exists() and "wrote" in capsys.readouterr().out
    assert cli(["report", str(tmp_path / "empty")]) == 2
    assert "telemetry.jsonl is missing" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        render_report(tmp_path / "empty")


def test_report_says_it_skipped_a_half_written_line(tmp_path, capsys):
    write_run(tmp_path, two_node_records())
    with (tmp_path / "telemetry.jsonl").open("a") as stream:
        stream.write('{"step": 110, "loss": 1.')  # the last line of a run killed while it wrote
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped 1 line(s) of {tmp_path / 'telemetry.jsonl'} that are no record (line 11): a line cut" in out
    assert "that are no record (line 11)" in (tmp_path / "report.html").read_text()


def test_report_says_where_the_wall_time_went(tmp_path, capsys):
    records = [{"step": s, "loss": 3.0} for s in (10, 20)]
    assert goodput_summary(records) is None  # telemetry without goodput: nothing claimed
    records[-1].update(
        goodput=0.75,
        goodput_wall_s=7200.0,
        goodput_productive_s=5400.0,
        goodput_restart_s=900.0,
        goodput_restarts=2,
        goodput_checkpoint_s=60.0,
        goodput_eval_s=300.0,
    )
    write_run(tmp_path, records)
    assert cli(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "goodput 0.75 at step 20: 1.5 h productive of 2.0 h; lost to 2 restarts 15.0 min, checkpoint stalls "
        "1.0 min, evaluations 5.0 min, other (start-up, data, logging) 9.0 min"
    )
    records[-1]["goodput_saves"] = 4  # one save's stall said too: the figure plan --checkpoint-seconds takes
    assert ", checkpoint stalls 1.0 min (4 saves, 15.0 s each), evaluations 5.0 min" in goodput_summary(records)
    assert "goodput 0.75 at step 20" in (tmp_path / "report.html").read_text()


def test_report_draws_lr_beside_the_losses_rates_from_zero_and_summarises_the_final_figures(tmp_path, monkeypatch):
    import hf_pretrain.report.dashboard as dashboard

    records = two_node_records()[:5]
    for record in records:
        record.update(learning_rate=1e-3 * record["step"] / 50, eval_loss=record["loss"] + 0.3)
        record.update(process_rss_gib=0.78 + record["step"] / 1000, cpu_utilization_pct=99.5 + record["step"] / 200)
    write_run(tmp_path, records)
    precision = {"recipe": "fp8", "matmuls": "fp8", "scaling": "rowwise"}
    (tmp_path / "preflight.json").write_text(json.dumps({"attention": {"rows": []}, "precision": precision}))
    figures = []
    monkeypatch.setattr(dashboard.plt, "close", figures.append)
    _, page = render_report(tmp_path)
    axes = {ax.get_title().split(" ")[0]: ax for ax in figures[0].axes if ax.get_title()}
    loss = axes["loss"]
    assert {line.get_label() for line in loss.lines if line.get_label()[0] != "_"} == {"loss", "eval_loss"}
    (twin,) = [ax for ax in figures[0].axes if ax is not loss and ax.bbox.bounds == loss.bbox.bounds]
    assert [line.get_label() for line in twin.lines] == ["learning_rate"] and twin.get_ylim()[0] == 0
    assert axes["tokens"].get_ylim()[0] == 0 and axes["MFU"].get_ylim()[0] == 0  # 5,000-9,000 tokens/s from 0
    assert loss.get_ylim()[0] > 0  # a loss keeps its own range
    assert axes["memory"].get_ylim()[0] == 0 and axes["utilization"].get_ylim() == (0, 105)  # 0.78-0.88 GiB
    said = {text.get_text() for ax in (axes["downstream:"], axes["time"]) for text in ax.texts}
    assert {"not run (pass --downstream_tasks)", "not logged (telemetry off)"} <= said  # no downstream, no goodput
    assert not any("unavailable" in text for text in said)  # nothing about the device
    text = page.read_text()
    assert "<th>precision</th><td>fp8 matmuls (recipe fp8, rowwise scaling)</td>" in text
    assert "<th>training loss</th><td>7.0000</td>" in text and "<th>held-out loss</th><td>7.3000</td>" in text
    assert "<th>learning rate</th><td>0.001</td>" in text and "<th>MFU (spec)</th><td>20.0%</td>" in text
    assert "<th>tokens / s</th><td>5,000</td>" in text  # the last, not the best


def test_report_says_an_older_preflight_holds_no_precision(tmp_path):
    write_run(tmp_path, two_node_records()[:3])
    (tmp_path / "preflight.json").write_text(json.dumps({"attention": {"rows": []}}))
    _, page = render_report(tmp_path)
    assert (
        "<th>precision</th><td>not in the run directory (preflight.json of an older version)</td>" in page.read_text()
    )


def test_report_stacks_the_goodput_so_the_parts_add_up_to_the_wall_time(tmp_path, monkeypatch):
    """Five cumulative lines drawn on top of each other read as one; stacked areas show where the time went."""
    import hf_pretrain.report.dashboard as dashboard

    records = [{"step": s, "loss": 3.0} for s in (10, 20, 30)]
    for i, record in enumerate(records, start=1):
        record.update(
            goodput_wall_s=100.0 * i,
            goodput_productive_s=70.0 * i,
            goodput_restart_s=10.0 * i,
            goodput_checkpoint_s=5.0 * i,
            goodput_eval_s=5.0 * i,
        )
    write_run(tmp_path, records)
    figures = []
    monkeypatch.setattr(dashboard.plt, "close", figures.append)
    render_report(tmp_path)
    (panel,) = [ax for ax in figures[0].axes if ax.get_title().startswith("time spent")]
    stacked = panel.collections
    assert [c.get_label() for c in stacked] == ["productive", "restart", "checkpoint", "eval", "other"]
    top = stacked[-1].get_paths()[0].vertices[:, 1].max()  # the last layer's upper edge: the wall time
    assert top == pytest.approx(300.0)
    (wall,) = [line for line in panel.lines if line.get_label() == "wall"]
    assert list(wall.get_ydata()) == [100.0, 200.0, 300.0]


def tiny_run_files(path, heldout_in_stream: bool):
    """What `make pretrain` leaves in runs/tiny for the report: training logs, train()'s last log and, with
    `heldout_in_stream`, the final evaluate()'s (versions before it reached telemetry.jsonl wrote none), and the
    example's pretrain_summary.json with the held-out loss it printed."""
    records = [
        {"step": s, "loss": 6.0 - s / 100, "learning_rate": 1e-3, "tokens_per_second": 6350.0,
         "num_input_tokens_seen": 4096 * s}
        for s in (100, 200, 300)
    ]  # fmt: skip
    records.append({"step": 300, "train_loss": 5.0587, "train_runtime": 195.4, "num_input_tokens_seen": 1228800})
    if heldout_in_stream:
        records.append({"step": 300, "eval_loss": 4.6489715576171875, "eval_runtime": 0.45})
    write_run(path, records)
    summary = {"train_loss": 5.0587, "train_seconds": 195.4, "tokens_seen": 1228800, "world_size": 1}
    summary.update(heldout_loss=4.6489715576171875, heldout_perplexity=104.48, unigram_entropy=6.5428)
    (path / "pretrain_summary.json").write_text(json.dumps(summary))


def test_report_says_the_held_out_loss_the_example_printed_and_what_was_not_run(tmp_path, capsys):
    """`make pretrain` printed `held-out loss 4.649`; the report of an older runs/tiny said 'not logged'. The figure
    is in pretrain_summary.json: read, and its source said; the stream's own figure comes first. On the console too."""
    tiny_run_files(tmp_path / "old", heldout_in_stream=False)
    assert cli(["report", str(tmp_path / "old")]) == 0
    out = capsys.readouterr().out
    assert "\nheld-out loss                 4.6490 (pretrain_summary.json)\n" in out
    assert "\ndownstream centered accuracy  not run (pass --downstream_tasks)\n" in out
    # throughput logged, no peak ever: the MFU is unavailable on this chip, not missing from the logs
    assert "\nMFU (spec)                    unavailable: no spec peak for this chip and precision" in out
    assert "\nMFU (measured ceiling)        unavailable: no native GEMM in this precision" in out
    assert "<th>held-out loss</th><td>4.6490 (pretrain_summary.json)</td>" in (tmp_path / "old/report.html").read_text()
    tiny_run_files(tmp_path / "new", heldout_in_stream=True)
    assert cli(["report", str(tmp_path / "new")]) == 0
    assert "\nheld-out loss                 4.6490\n" in capsys.readouterr().out
    (tmp_path / "old" / "pretrain_summary.json").write_text('{"heldout_loss": 4.6')  # cut short
    assert cli(["report", str(tmp_path / "old")]) == 0
    assert "held-out loss                 not logged (pretrain_summary.json is no JSON)" in capsys.readouterr().out
