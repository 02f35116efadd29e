"""`moeserve eval`: held-out quality of a checkpoint on the Python-source corpus."""
