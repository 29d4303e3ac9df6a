"""Linear layers that keep their weight in two layouts, for float32 matmuls on CPU.

Measured with this project's torch (MKL sgemm, AVX-512, 1-2 threads): x @ W^T with
nn.Linear's [out, in] weight costs about 2x more from 4 rows of x on than at 1-3 rows,
while x @ W_t with a contiguous [in, out] copy stays nearly flat up to 16 rows (and is a
little slower at 2-3 rows). SmolLM2's target forward over 4 tokens: 100 ms -> 71 ms; 8
tokens: 110 -> 72 ms. Verifying K >= 3 draft tokens, batched samples and short prefills
all run 4+ rows, so the target pays for K = 3 about what it pays for K = 2.

The price is a second copy of every linear weight (2x weight memory), so it is a setting
(`dual_layout_min_rows`, 0 = off) and only applies to float32 models on CPU.
"""

from __future__ import annotations

import torch


class DualLayoutLinear(torch.nn.Module):
    """nn.Linear's result, computed with the faster of two weight layouts for the row count."""

    def __init__(self, linear: torch.nn.Linear, min_rows: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = min_rows
        self.weight = linear.weight  # shared (a tied embedding keeps using it)
        self.bias = linear.bias
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if rows < self.min_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


def use_dual_layout(model: torch.nn.Module, min_rows: int) -> int:
    """Swap every plain float32 CPU nn.Linear of `model` for a DualLayoutLinear; returns how many."""
    if min_rows <= 0:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, DualLayoutLinear(child, min_rows))
                swapped += 1
    return swapped
