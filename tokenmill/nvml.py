"""NVML handles for the GPU that CUDA calls device `cuda_index`. NVML numbers the machine's GPUs and ignores
CUDA_VISIBLE_DEVICES, so with CUDA_VISIBLE_DEVICES=3 the engine's cuda:0 is NVML's GPU 3 (or a UUID).

NVML numbers GPUs in PCI bus order; CUDA by default puts the fastest first and leaves the rest's order
unspecified, so numeric entries map exactly only under CUDA_DEVICE_ORDER=PCI_BUS_ID (UUID entries always do).
Asking CUDA for the UUID would be exact everywhere, but the dashboard runs in the API server's process, which
must not initialize CUDA."""
from __future__ import annotations

import os


def device_handle(pynvml, cuda_index: int = 0):
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if cuda_index >= len(visible):  # unset (every GPU visible in NVML's order), or fewer entries than asked
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)  # GPU-... or MIG-...
