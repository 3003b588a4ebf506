#!/usr/bin/env python3
"""torch.distributed's gloo backend measured as kiln bench comms measures itself (the peer of
scripts/bench_comms.sh): N processes on 127.0.0.1, CPU tensors, per-iteration time of the
slowest rank (an all_reduce MAX of the times), median; algbw = S / time and busbw as nccl-tests
(2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, S the all_reduce tensor,
the all_gather output and the reduce_scatter input). One JSON line per (op, size) on --out.

    python3 scripts/bench_comms_peers.py --nproc 4 --ops all_reduce,all_gather,reduce_scatter \
        --bytes 1M,64M --iters 20 --out torch_gloo.jsonl
"""
import argparse
import json
import os
import socket
import statistics
import time


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


def worker(rank, args, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    n = args.nproc
    out = open(args.out, "a") if rank == 0 else None
    for op in args.ops.split(","):
        for text in args.bytes.split(","):
            elems = parse_bytes(text) // 4
            if op != "all_reduce":
                elems -= elems % n
            chunk = elems // n if op in ("all_gather", "reduce_scatter") else elems
            big = torch.zeros(elems, dtype=torch.float32)
            small = torch.zeros(chunk, dtype=torch.float32)

            def once():
                if op == "all_reduce":
                    dist.all_reduce(big)
                elif op == "all_gather":
                    try:
                        dist.all_gather_into_tensor(big, small)
                    except (RuntimeError, AttributeError):
                        dist.all_gather(list(big.chunk(n)), small)
                else:
                    try:
                        dist.reduce_scatter_tensor(small, big)
                    except (RuntimeError, AttributeError):
                        dist.reduce_scatter(small, list(big.chunk(n)))

            for _ in range(args.warmup):
                once()
            dist.barrier()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                once()
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            med = statistics.median(t.tolist())
            data = elems * 4
            algbw = data / med / 1e9
            factor = 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
            if out:
                rec = {"bench": "comms", "impl": "torch_gloo", "torch": torch.__version__, "backend": "gloo",
                       "device": "cpu", "op": op, "world_size": n, "bytes": data, "shape": [elems], "dtype": "f32",
                       "iters": args.iters, "ms_median": med * 1e3, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                       "peak_bytes": big.numel() * 4 + small.numel() * 4}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"torch gloo {op:15s} {n} ranks {data:>12d} B  {med * 1e6:10.1f} us  busbw {algbw * factor:.3f} GB/s",
                      flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--bytes", default="1M,64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
