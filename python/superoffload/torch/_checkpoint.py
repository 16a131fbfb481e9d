"""The library's checkpoint file (safetensors: `master/<slice>`, `exp_avg/<slice>`,
`exp_avg_sq/<slice>` + metadata and a checksum) read into torch tensors and written from them.

Reading maps the file (`torch.from_file`, private mapping) and returns views of it: no copy of the
data is made in anonymous memory. Writing streams each tensor's bytes to the file. The checksum
is the library's (a 64-bit multiply-rotate over every tensor's name and bytes, then every
metadata entry but the checksum, in name order); `tests/test_layer.py` checks it against files
the library wrote.

SuperOffloadAdamW's state dict goes through such a file when the dynamic loss scaler is on, whose
state the session keeps and only a checkpoint file carries; otherwise it reads and writes the
master and moment buffers directly.
"""
import json
import os
import struct

import torch

FORMAT = "superoffload-checkpoint"
FORMAT_VERSION = "1"

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

_K = 0x9E3779B97F4A7C15
_H0 = 0x243F6A8885A308D3
_M = (1 << 64) - 1


def _mix_bytes(h, data):
    """Folds `data` (a bytes-like object) into the running hash `h`, 8 bytes at a time."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    full = n - n % 8
    K, M = _K, _M
    if full:
        for (w,) in struct.iter_unpack("<Q", mv[:full]):
            h = ((h ^ w ^ 8) * K) & M
            h = ((h << 29) | (h >> 35)) & M
    if n % 8:
        tail = bytes(mv[full:]) + b"\0" * (8 - n % 8)
        (w,) = struct.unpack("<Q", tail)
        h = ((h ^ w ^ (n % 8)) * K) & M
        h = ((h << 29) | (h >> 35)) & M
    return h


def _mix_part(h, name, data):
    h = _mix_bytes(h, name.encode())
    h = _mix_bytes(h, data)
    length = len(memoryview(data).cast("B"))
    h = ((h ^ length) * _K) & _M
    return ((h << 29) | (h >> 35)) & _M


def _bytes_of(t):
    t = t.detach().contiguous()
    return t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""


def checksum(tensors, meta):
    """The library's checkpoint checksum of {name: tensor} and {key: str} (hex, 16 digits)."""
    h = _H0
    for name in sorted(tensors):
        h = _mix_part(h, name, _bytes_of(tensors[name]))
    for key in sorted(k for k in meta if k != "checksum"):
        h = _mix_part(h, key, meta[key].encode())
    return f"{h:016x}"


def read(path):
    """(metadata dict, {name: 1-d tensor viewing the mapped file}). The mapping stays valid after
    the file is removed."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    meta = header.pop("__metadata__", {}) or {}
    buf = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        dt = _ST_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        raw = buf[base + start:base + end]
        item = torch.tensor([], dtype=dt).element_size()
        if (base + start) % item:
            raw = raw.clone()  # misaligned for a typed view: copy this one tensor
        out[name] = raw.view(dt).reshape(int(info["shape"][0]) if info["shape"] else ())
    return meta, out


def write(path, tensors, meta, known_checksum=None):
    """Writes a checkpoint file the library's so_session_load accepts: `tensors` {name: tensor},
    `meta` {key: str} without the checksum, which is computed here (in Python: about 20 MB/s)
    unless `known_checksum` is given (the checksum of a file the library wrote with exactly these
    tensors and metadata: the library verifies it on load). Atomic (temporary file + rename)."""
    meta = {k: v for k, v in meta.items() if k != "checksum"}
    meta["checksum"] = known_checksum or checksum(tensors, meta)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, off = {}, 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": [t.numel()], "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for name in order:
                f.write(_bytes_of(tensors[name]))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
