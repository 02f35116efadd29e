"""Capacity and deployment planner (`moeserve plan`): pure arithmetic, no torch, no GPU."""
