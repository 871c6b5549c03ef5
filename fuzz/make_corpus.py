"""Writes the seed corpus of fuzz/request_fuzzer.cc (fuzz/corpus/request):
valid and invalid Forward and Backward requests, each as a selector byte
(0: ForwardRequest, 1: BackwardRequest) and the serialized message.

Usage (after `bazel build //client/python:flce_pb`):
  PYTHONPATH=bazel-bin/client/python /usr/bin/python3 fuzz/make_corpus.py
"""

import hashlib
import os

import numpy as np

from flce_pb.v1 import loss_service_pb2 as pb

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "request")


def tensor(arr, dtype):
    t = pb.Tensor(dtype=dtype, shape=list(arr.shape))
    t.data = arr.tobytes()
    return t


def forward(n=3, h=5, v=7, dtype=np.float32, wire=pb.DTYPE_FLOAT32, **kw):
    rng = np.random.default_rng(n * 100 + h * 10 + v)
    r = pb.ForwardRequest()
    r.hidden.CopyFrom(tensor(rng.standard_normal((n, h)).astype(dtype), wire))
    if kw.get("weight_ref"):
        r.weight_ref.name = "w"
    else:
        r.weight.CopyFrom(tensor(rng.standard_normal((v, h)).astype(dtype), wire))
        if kw.get("bias"):
            r.bias.CopyFrom(tensor(rng.standard_normal(v).astype(dtype), wire))
    r.target.CopyFrom(tensor(rng.integers(0, v, n).astype(np.int64), pb.DTYPE_INT64))
    o = r.options
    o.ignore_index = -100
    if kw.get("options"):
        o.label_smoothing = 0.1
        o.logit_softcap = 5.0
        o.z_loss_scale = 1e-3
        o.class_weight.CopyFrom(tensor(rng.random(v).astype(np.float32), pb.DTYPE_FLOAT32))
    o.reduction = kw.get("reduction", pb.REDUCTION_MEAN)
    r.need_backward = kw.get("need_backward", True)
    r.backward_mode = kw.get("mode", pb.BACKWARD_MODE_AUTO)
    r.outputs.lse = True
    return r


def seeds():
    yield 0, forward()
    yield 0, forward(dtype=np.float16, wire=pb.DTYPE_FLOAT16, bias=True)
    yield 0, forward(weight_ref=True)
    yield 0, forward(options=True, reduction=pb.REDUCTION_NONE, mode=pb.BACKWARD_MODE_RECOMPUTE)
    yield 0, forward(reduction=pb.REDUCTION_SUM, mode=pb.BACKWARD_MODE_STORE_GRADS)
    yield 0, forward(n=0)
    bf16 = forward()
    bf16.hidden.dtype = pb.DTYPE_BFLOAT16
    bf16.hidden.shape[:] = [3, 10]
    yield 0, bf16
    shm = forward()
    shm.hidden.ClearField("data")
    shm.hidden.shm.region_id = "region"
    shm.hidden.shm.offset = 64
    yield 0, shm
    bad_target = forward()
    bad_target.target.data = np.array([0, 9, -100], np.int64).tobytes()
    yield 0, bad_target
    huge = forward()
    huge.hidden.shape[:] = [1 << 40, 1 << 40]
    yield 0, huge
    negative = forward()
    negative.weight.shape[:] = [-7, 5]
    yield 0, negative
    mismatch = forward()
    mismatch.weight.shape[:] = [5, 7]
    yield 0, mismatch
    b = pb.BackwardRequest(session_id="0" * 32)
    yield 1, b
    b2 = pb.BackwardRequest(session_id="0" * 32, keep_session=True, grad_dtype=pb.DTYPE_FLOAT32)
    b2.grad_output.CopyFrom(tensor(np.ones(3, np.float32), pb.DTYPE_FLOAT32))
    b2.grad_hidden_out.region_id = "region"
    b2.grad_hidden_out.offset = 128
    yield 1, b2
    b3 = pb.BackwardRequest(session_id="x", accumulate_weight_grad=True)
    b3.grad_output.CopyFrom(tensor(np.ones((), np.float16), pb.DTYPE_FLOAT16))
    yield 1, b3


def main():
    os.makedirs(OUT, exist_ok=True)
    for kind, message in seeds():
        data = bytes([kind]) + message.SerializeToString()
        name = hashlib.sha1(data).hexdigest()
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
