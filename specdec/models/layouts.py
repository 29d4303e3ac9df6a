"""Names of the matmul layouts `specdec.models.cpu_layout` can run (torch-free, for settings)."""

LINEAR = "linear"  # F.linear(x, W), W as nn.Linear stores it: [out, in]
TRANSPOSED = "transposed"  # x @ W_t, a contiguous [in, out] copy (2x weight memory)
WEIGHT_MAJOR = "weight_major"  # (W @ x^T)^T, W as stored
PACKED = "packed"  # oneDNN's inner product on a copy of W reordered for it once (2x weight memory)
PANELS = "panels"  # a compiled kernel on a copy of W in 32-output panels (2x weight memory; panels.py)
LAYOUTS = (LINEAR, TRANSPOSED, WEIGHT_MAJOR, PACKED, PANELS)
COPIES = (TRANSPOSED, PACKED, PANELS)  # the layouts that keep a second copy of each weight
AUTO = "auto"  # measure at start and keep the fastest per row count (specdec.models.calibration)
