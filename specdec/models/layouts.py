"""Names of the matmul layouts `specdec.models.cpu_layout` can run (torch-free, for settings)."""

LINEAR = "linear"  # F.linear(x, W), W as nn.Linear stores it: [out, in]
TRANSPOSED = "transposed"  # x @ W_t, a contiguous [in, out] copy (2x weight memory)
WEIGHT_MAJOR = "weight_major"  # (W @ x^T)^T, W as stored
LAYOUTS = (LINEAR, TRANSPOSED, WEIGHT_MAJOR)
AUTO = "auto"  # measure at start and keep the fastest per row count (specdec.models.calibration)
