"""Pure PyTorch reference implementations of every op; they run anywhere, CPU included."""
