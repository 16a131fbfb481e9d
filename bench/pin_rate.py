"""GPU: page-locking host memory (cudaHostRegister) and copying it to the device, from pageable and from pinned memory.

These rates bound how fast a session can move host state onto the GPU: the automatic split's
placement copies each placed sub-group's master weights and moments (docs/performance.md,
"Settling"). The buffers are written before they are timed, so their pages are resident as a
session's moments are.

  python bench/pin_rate.py                  # 1 and 4 GiB
  python bench/pin_rate.py --gib 1,4,16
"""
import argparse
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", default="1,4", help="comma-separated buffer sizes in GiB")
    args = p.parse_args()
    import torch
    cudart = torch.cuda.cudart()
    print(torch.cuda.get_device_name(), flush=True)

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
        unregister = timed(lambda: cudart.cudaHostUnregister(host.data_ptr()))
        print(f"{gib} GiB: register {register * 1e3:.0f} ms ({n / register / 1e9:.1f} GB/s), unregister "
              f"{unregister * 1e3:.0f} ms; to the device from pageable memory {n / pageable / 1e9:.1f} GB/s, "
              f"from pinned {n / pinned / 1e9:.1f} GB/s", flush=True)
        del host, device


if __name__ == "__main__":
    main()
