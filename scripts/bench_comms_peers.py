#!/usr/bin/env python3
"""torch.distributed measured as kiln bench comms measures itself (the peer of scripts/bench_comms.sh):
N processes on 127.0.0.1, per-iteration time of the slowest rank (an all_reduce MAX of the times),
median; algbw = S / time and busbw as nccl-tests (2(n-1)/n for all_reduce, (n-1)/n for all_gather
and reduce_scatter, S the all_reduce tensor, the all_gather output and the reduce_scatter input).
One JSON line per (op, size) on --out, impl "torch_<backend>".

--backend gloo (default): CPU tensors. --backend nccl --device cuda: one GPU per rank (cuda:<rank>),
all_gather_into_tensor / reduce_scatter_tensor, each timed iteration ends with a
torch.cuda.synchronize() (kiln's Work.wait returns once the operation has finished on the device).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless already set).

    python3 scripts/bench_comms_peers.py --nproc 4 --ops all_reduce,all_gather,reduce_scatter \\
        --bytes 1M,64M --iters 20 --out torch_gloo.jsonl
    python3 scripts/bench_comms_peers.py --backend nccl --device cuda --dtype bf16 --nproc 8 \\
        --bytes 1M,64M,1G --out torch_nccl.jsonl
"""
import argparse
import json
import statistics
import time

from dist_spawn import spawn_ranks

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "i32": "int32", "i64": "int64",
          "u8": "uint8"}


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


def worker(rank, args, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    kw = {"device_id": dev} if cuda else {}
    try:
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.nproc, **kw)
    except TypeError:  # a torch without device_id
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    n = args.nproc
    dtype = getattr(torch, DTYPES[args.dtype])
    item = torch.empty((), dtype=dtype).element_size()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = open(args.out, "a") if rank == 0 else None
    for op in args.ops.split(","):
        for text in args.bytes.split(","):
            elems = parse_bytes(text) // item
            if op != "all_reduce":
                elems -= elems % n
            chunk = elems // n if op in ("all_gather", "reduce_scatter") else elems
            big = torch.zeros(elems, dtype=dtype, device=dev)
            small = torch.zeros(chunk, dtype=dtype, device=dev)

            def once():
                if op == "all_reduce":
                    dist.all_reduce(big)
                elif op == "all_gather":
                    try:
                        dist.all_gather_into_tensor(big, small)
                    except (RuntimeError, AttributeError):
                        if cuda:
                            raise
                        dist.all_gather(list(big.chunk(n)), small)
                else:
                    try:
                        dist.reduce_scatter_tensor(small, big)
                    except (RuntimeError, AttributeError):
                        if cuda:
                            raise
                        dist.reduce_scatter(small, list(big.chunk(n)))

            for _ in range(args.warmup):
                once()
            sync()
            dist.barrier()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                once()
                sync()
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            med = statistics.median(t.tolist())
            data = elems * item
            algbw = data / med / 1e9
            factor = 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
            if out:
                rec = {"bench": "comms", "impl": f"torch_{args.backend}", "torch": torch.__version__,
                       "backend": args.backend, "device": str(dev), "op": op, "world_size": n, "bytes": data,
                       "shape": [elems], "dtype": args.dtype, "iters": args.iters, "ms_median": med * 1e3,
                       "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                       "peak_bytes": (big.numel() + small.numel()) * item}
                if cuda:
                    rec["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"torch {args.backend} {op:15s} {n} ranks {data:>12d} B  {med * 1e6:10.1f} us  "
                      f"busbw {algbw * factor:.3f} GB/s", flush=True)
            del big, small
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda for nccl, cpu for gloo")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--bytes", default="1M,64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc} must be at least 1")
    bad = set(args.ops.split(",")) - {"all_reduce", "all_gather", "reduce_scatter"}
    if bad:
        ap.error(f"--ops: unknown {','.join(sorted(bad))} (expected all_reduce, all_gather, reduce_scatter)")
    spawn_ranks(worker, args, args.nproc, args.device, "bench_comms_peers")


if __name__ == "__main__":
    main()
