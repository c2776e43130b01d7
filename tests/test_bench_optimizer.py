"""``bench optimizer``'s three AdamW steps make the same update (the GPU benchmark times them), and its
floor counts seven tensors of the parameters' dtype."""

import torch

from benchmarks import optimizer


def test_the_steps_make_the_same_update():
    torch.manual_seed(0)
    start = [torch.randn(33, 7), torch.randn(5)]
    grads = [torch.randn_like(p) for p in start]
    results = {}
    torch._dynamo.reset()
    for kind in optimizer.KINDS:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        step = optimizer.optimizer_step(kind, params)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            step()
        results[kind] = [p.detach() for p in params]
    moved = max((a - b).abs().max().item() for a, b in zip(results["fused"], start))
    assert moved > 1e-7  # the steps did update
    for kind in ("foreach", "compiled"):
        for a, b in zip(results[kind], results["fused"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_floor_counts_seven_tensors_of_the_parameters_dtype():
    params = [torch.nn.Parameter(torch.zeros(10, 3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4))]
    assert optimizer.floor_bytes(params) == 7 * (30 * 2 + 4 * 4)
