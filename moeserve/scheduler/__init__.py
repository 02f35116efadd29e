"""Continuous batching: admission, chunked prefill, retraction."""

from moeserve.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]
