"""GPU: page-locking host memory (cudaHostRegister) and copying it to the device, from pageable and from pinned memory.

These rates bound how fast a session can move host state onto the GPU: the automatic split's
placement copies each placed sub-group's master weights and moments (docs/performance.md,
"Settling"). The buffers are written before they are timed, so their pages are resident as a
session's moments are. It also times a device allocation made while a copy is queued (one that
waited for the copy would serialize a placement's copies).

  python bench/pin_rate.py                  # 1 and 4 GiB
  python bench/pin_rate.py --gib 1,4,16
"""
import argparse
import ctypes
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", default="1,4", help="comma-separated buffer sizes in GiB")
    args = p.parse_args()
    import torch
    cudart = torch.cuda.cudart()
    print(torch.cuda.get_device_name(), flush=True)

    driver = ctypes.CDLL("libcuda.so.1")

    def timed_alloc(nbytes):
        """Seconds a cuMemAlloc of `nbytes` takes on the host (the memory is freed again after)."""
        ptr = ctypes.c_uint64()
        start = time.perf_counter()
        status = driver.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        took = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"cuMemAlloc of {nbytes} bytes failed: CUresult {status}")
        torch.cuda.synchronize()
        driver.cuMemFree_v2(ptr)
        return took

    def timed(f):
        start = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for gib in (int(g) for g in args.gib.split(",")):
        n = gib << 30
        host = torch.empty(n, dtype=torch.uint8)
        host.fill_(1)
        device = torch.empty(n, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        pageable = timed(lambda: device.copy_(host, non_blocking=True))
        status = []
        register = timed(lambda: status.append(cudart.cudaHostRegister(host.data_ptr(), n, 0)))
        if int(status[0]) != 0:
            raise SystemExit(f"cudaHostRegister of {gib} GiB failed: {status[0]}")
        pinned = timed(lambda: device.copy_(host, non_blocking=True))
        # A placement allocates each sub-group's device state between the queued copies of the
        # sub-groups before it: an allocation that waited for them would serialize the copies.
        device.copy_(host, non_blocking=True)
        alloc_s = timed_alloc(1 << 30)
        torch.cuda.synchronize()
        unregister = timed(lambda: cudart.cudaHostUnregister(host.data_ptr()))
        print(f"{gib} GiB: register {register * 1e3:.0f} ms ({n / register / 1e9:.1f} GB/s), unregister "
              f"{unregister * 1e3:.0f} ms; to the device from pageable memory {n / pageable / 1e9:.1f} GB/s, "
              f"from pinned {n / pinned / 1e9:.1f} GB/s ({pinned * 1e3:.0f} ms); cuMemAlloc of 1 GiB while "
              f"that copy is queued: {alloc_s * 1e3:.1f} ms", flush=True)
        del host, device


if __name__ == "__main__":
    main()
