"""Linear layers that compute x @ W^T with the fastest float32 CPU kernel for the row count.

Five ways to compute nn.Linear's product, all exact up to float32 rounding, with very different
costs for the few rows a decode step or a Verify runs (SmolLM2-135M on this 2-vCPU EPYC,
cached forward: milliseconds per forward by rows):

    layout        what runs                              1 row   2 rows  3 rows  4 rows
    linear        F.linear(x, W)      (W: [out, in])       ~50     ~80    ~100     ~85
    transposed    x @ W_t   (a contiguous [in, out] copy)  ~43     ~65     ~80     ~90
    weight_major  (W @ x^T)^T          (W as stored)       ~51     ~60     ~68     ~61
    packed        oneDNN inner product (W reordered once)
    panels        specdec.models.panels' kernel (W in 32-output panels)

The matmuls alone, every SmolLM2 layer's weights streamed once, 1 thread (ms, busy machine):
packed 43 / 45 / 50 / 61 / 63 / 73 at 1 / 2 / 3 / 4 / 6 / 8 rows, against the best of the first
three per shape 31 / 47 / 62 / 58 / 81 / 86: oneDNN reads W once for a few rows where MKL's
small-M kernels do not, but it costs a fixed ~30 us more a call, so one row stays with MKL. In
batched steps (scripts/step_bench.py's shapes, quiet, 2 threads, calibrated plans with and
without it): 8 sessions x 1 token 194 vs 286 ms, 16 x 1 304 vs 407 ms, 1 x 1 57 vs 69 ms.

A forward streams every weight from memory once per call, so a kernel that reads W once for
all rows costs about what one row costs; MKL's choice of kernel (and whether it repacks W) decides
whether it does. Which kernel wins depends on the CPU, the thread count and the shapes, so the
services measure it at start (`specdec.models.calibration`) and keep the winner per row count in a
`LayoutPlan`. `transposed`, `packed` and `panels` each keep a second copy of each weight; a copy is
dropped when no row count chose it.

`panels` (specdec.models.panels) is a compiled kernel that streams W once for all rows: on an AMX
Xeon, 2 threads, SmolLM2's cached forward with it for every shape took 32.7 / 37.0-37.5 / 41.8-42.1
ms at 1 / 3 / 5 rows against 34.5-35.8 / 38.5-38.9 / 51.3-51.4 with the other four tuned per shape,
and a step of 8 decodes 66.5-70.6 against 76.9-77.8 ms (step_bench, 400 cached tokens); from the
exact 4- and 8-bit copies it keeps of the packaged target's weights (GGUF blocks), 17.8 / 19.8 /
21.3 ms and 46.4 ms. Its copy is then a fraction of the weight's size.
"""

from __future__ import annotations

import torch

from specdec.models import panels
from specdec.models.layouts import COPIES, LAYOUTS, LINEAR, PACKED, PANELS, TRANSPOSED, WEIGHT_MAJOR


class LayoutPlan:
    """The layout per row count, shared by every swapped linear of a model (one object to tune).

    Row counts past the largest one measured use that one's layout.
    """

    def __init__(self, default: str = LINEAR, by_rows: dict[int, str] | None = None):
        _check_layout(default)
        self.default = default
        self.by_rows: dict[int, str] = {}
        for rows, layout in (by_rows or {}).items():
            self.set(rows, layout)

    def set(self, rows: int, layout: str) -> None:
        _check_layout(layout)
        self.by_rows[rows] = layout

    def layout(self, rows: int) -> str:
        chosen = self.by_rows.get(rows)
        if chosen is not None:
            return chosen
        if self.by_rows and rows > max(self.by_rows):
            return self.by_rows[max(self.by_rows)]
        return self.default

    def uses(self, layout: str) -> bool:
        return layout == self.default or layout in self.by_rows.values()


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown linear layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


class PlannedLinear(torch.nn.Module):
    """nn.Linear's result, computed in the layout its plan gives for the row count."""

    def __init__(
        self, linear: torch.nn.Linear, plan: LayoutPlan, copies: tuple[str, ...] = COPIES, int8: bool = False
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plan = plan
        self.weight = linear.weight  # shared (a tied embedding keeps using it)
        self.bias = linear.bias
        weight = linear.weight.detach()
        weight_t = weight.t().contiguous() if TRANSPOSED in copies else None
        self.register_buffer("weight_t", weight_t, persistent=False)
        # An opaque oneDNN tensor: not a buffer, so state_dict and .to() never see it.
        self.weight_packed = _pack(weight) if PACKED in copies else None
        # Plain tensors too: the kernel reads their memory directly (panels.py). A 4- or 8-bit form
        # where the weight is exactly one: the same products, bit for bit, from a sixth or a third of the bytes.
        self.weight_panels = None
        if (int8 or PANELS in copies) and panels.available():
            compact = panels.pack_compact(weight)
            if int8 and compact is not None:
                # Every row count in int8 (kernels/int8.cpp), whatever the plan: another layout's float32
                # product would make a Verify's rows differ from its decodes by the rounding of x.
                self.weight_panels = panels.to_int8(compact)
            elif PANELS in copies:
                self.weight_panels = compact or panels.pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        layout = self.plan.layout(rows)
        if self.int8:
            y = panels.product(x.reshape(rows, self.in_features), self.weight_panels, self.out_features)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif layout == TRANSPOSED and self.weight_t is not None:
            y = torch.matmul(x, self.weight_t)
        elif layout == WEIGHT_MAJOR:
            y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t()
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif layout == PACKED and self.weight_packed is not None and not torch.compiler.is_compiling():
            # (Inductor cannot lower the opaque oneDNN weight: a compiled graph chooses its own kernel.)
            flat = x.reshape(rows, self.in_features).contiguous()
            y = packed_product(flat, self.weight_packed)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif (
            layout == PANELS
            and rows <= panels.MAX_ROWS
            and self.weight_panels is not None
            and not torch.compiler.is_compiling()
        ):
            y = panels.product(x.reshape(rows, self.in_features), self.weight_panels, self.out_features)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias

    @property
    def int8(self) -> bool:
        """Whether its products round x to 8-bit blocks (`panels.to_int8`): every row, any layout."""
        return isinstance(self.weight_panels, panels.INT8_FORMS)

    def has_copy(self, layout: str) -> bool:
        copy = {TRANSPOSED: self.weight_t, PACKED: self.weight_packed, PANELS: self.weight_panels}.get(layout)
        return copy is not None


def packing_available() -> bool:
    """Whether this torch build has oneDNN's inner product (the `packed` layout)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    return pack_weight(weight) if packing_available() else None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W ([out, in], its own dtype) reordered once for oneDNN's inner product (`packed_product`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_product(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows @ W^T ([R, in] -> [R, out], in the rows' dtype) for a W from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


def use_layout_plans(
    model: torch.nn.Module, layout: str, copies: tuple[str, ...] = COPIES, int8: bool = False
) -> dict[tuple[int, int], LayoutPlan]:
    """Swap every plain float32 CPU nn.Linear of `model` for a PlannedLinear, starting on `layout`
    and keeping the weight copies `copies` (a layout whose copy is missing runs as `linear`); returns the plans, one per weight shape (in_features, out_features), shared by its layers.
    int8: those whose weights are 4- or 8-bit blocks multiply int8 rows instead, at every row count.

    Per shape because the kernels' costs differ by shape: on this CPU at 2 rows, (W @ x^T)^T is the
    fastest form of SmolLM2's 576 -> 1536 projections and the slowest of its 1536 -> 576 one.
    """
    plans: dict[tuple[int, int], LayoutPlan] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                plan = plans.setdefault((child.in_features, child.out_features), LayoutPlan(layout))
                setattr(parent, name, PlannedLinear(child, plan, copies, int8))
    return plans


def round_to_q8_blocks(model: torch.nn.Module) -> int:
    """Round the weights of `model`'s float32 CPU nn.Linears that are not 4- or 8-bit blocks already
    to 8-bit blocks (`panels.q8_rounded`), so that int8 products serve them (a draft: its numerics
    never reach the output law, and its forward then reads a quarter of the bytes); returns how many.
    Before `use_layout_plans`; a weight shared with an embedding is rounded there too."""
    rounded = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(module) is not torch.nn.Linear or weight.dtype != torch.float32 or weight.device.type != "cpu":
                continue
            if module.in_features % panels.BLOCK or panels.pack_compact(weight) is not None:
                continue
            weight.copy_(panels.q8_rounded(weight))
            rounded += 1
    return rounded


def planned_linears(model: torch.nn.Module) -> dict[tuple[int, int], list[PlannedLinear]]:
    """The model's PlannedLinears by weight shape (in_features, out_features)."""
    by_shape: dict[tuple[int, int], list[PlannedLinear]] = {}
    for module in model.modules():
        if isinstance(module, PlannedLinear):
            by_shape.setdefault((module.in_features, module.out_features), []).append(module)
    return by_shape


def drop_unused_copies(model: torch.nn.Module) -> int:
    """Free the weight copies (transposed, packed) its plan does not use; returns how many."""
    dropped = 0
    for module in model.modules():
        if not isinstance(module, PlannedLinear):
            continue
        if module.weight_t is not None and not module.plan.uses(TRANSPOSED):
            module.weight_t = None
            dropped += 1
        if module.weight_packed is not None and not module.plan.uses(PACKED):
            module.weight_packed = None
            dropped += 1
        if module.weight_panels is not None and not module.plan.uses(PANELS) and not module.int8:
            module.weight_panels = None
            dropped += 1
    return dropped
