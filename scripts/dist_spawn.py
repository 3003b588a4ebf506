"""Starting the ranks of the torch.distributed benchmark peers (scripts/bench_comms_peers.py,
scripts/bench_fsdp_torch.py): NVLink multicast off in every rank's environment (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set), one GPU per rank checked
for device "cuda", a free port on 127.0.0.1 for the TCP rendezvous, and torch.multiprocessing.spawn
calling worker(rank, args, port) in each rank."""
import os
import socket
import sys


def spawn_ranks(worker, args, nproc, device, who):
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(k, v)
    import torch
    import torch.multiprocessing as mp

    if device == "cuda" and torch.cuda.device_count() < nproc:
        sys.exit(f"{who}: {nproc} ranks need {nproc} GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=nproc, join=True)
