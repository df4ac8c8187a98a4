"""Training-loop state that PyTorch does not checkpoint: data position, gradient accumulation."""
