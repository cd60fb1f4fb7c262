"""Run report: a PNG dashboard and an HTML page from a run's telemetry.jsonl."""

from .dashboard import render_report

__all__ = ["render_report"]
