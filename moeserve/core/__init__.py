"""Requests, sampling parameters, outputs and the scheduler's batch."""
