"""Protobuf <-> domain conversions shared by the services (probability arrays, sampling)."""

from __future__ import annotations

import numpy as np

from specdec.sampling import Sampling
from specdec.v1 import common_pb2

_DTYPES = {
    common_pb2.DTYPE_FLOAT32: np.float32,
    common_pb2.DTYPE_FLOAT64: np.float64,
    common_pb2.DTYPE_FLOAT16: np.float16,
}


def encode_probs(probs: np.ndarray) -> common_pb2.ProbTensor:
    """[N, V] float32 array -> ProbTensor (raw bytes; never `repeated float`)."""
    probs = np.ascontiguousarray(probs, dtype=np.float32)
    return common_pb2.ProbTensor(data=probs.tobytes(), shape=list(probs.shape), dtype=common_pb2.DTYPE_FLOAT32)


def encode_hidden_states(hidden: np.ndarray) -> common_pb2.ProbTensor:
    """[N, H] hidden states -> float16 ProbTensor: half the bytes, and float16 is what drafts
    are trained on (the distillation cache stores them so)."""
    hidden = np.ascontiguousarray(hidden, dtype=np.float16)
    return common_pb2.ProbTensor(data=hidden.tobytes(), shape=list(hidden.shape), dtype=common_pb2.DTYPE_FLOAT16)


def decode_probs(tensor: common_pb2.ProbTensor) -> np.ndarray:
    """ProbTensor -> read-only numpy array of its shape; ValueError when inconsistent."""
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"unsupported probability dtype {tensor.dtype}")
    dtype = np.dtype(_DTYPES[tensor.dtype]).newbyteorder("<")
    shape = tuple(tensor.shape)
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"probability tensor has {len(tensor.data)} bytes, shape {shape} needs {expected}")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def sampling_from_proto(params: common_pb2.SamplingParams) -> Sampling:
    """Proto sampling params -> validated Sampling (unset temperature / top_p mean 1)."""
    temperature = params.temperature if params.HasField("temperature") else 1.0
    top_p = params.top_p if params.HasField("top_p") else 1.0
    sampling = Sampling(temperature=float(temperature), top_k=int(params.top_k), top_p=float(top_p))
    validate_sampling(sampling)
    return sampling


def sampling_to_proto(sampling: Sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def validate_sampling(sampling: Sampling) -> None:
    """ValueError with a user-facing message for out-of-range sampling parameters."""
    if not np.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {sampling.temperature}")
    if sampling.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if not (0.0 < sampling.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
