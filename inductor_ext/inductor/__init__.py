"""The ``fastops_inductor`` torch.compile backend."""
