"""Tracking: metrics to JSONL (always), TensorBoard, W&B, MLflow; a progress bar with tokens/s and ETA."""

from posttrain.tracking.sinks import (
    JSONLSink,
    MetricsSink,
    MLflowSink,
    TensorBoardSink,
    TrackingError,
    WandbSink,
    read_metrics,
)
from posttrain.tracking.tracker import METRICS_FILE, TENSORBOARD_DIR, Tracker, console, say

__all__ = [
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "JSONLSink",
    "MLflowSink",
    "MetricsSink",
    "TensorBoardSink",
    "Tracker",
    "TrackingError",
    "WandbSink",
    "console",
    "read_metrics",
    "say",
]
