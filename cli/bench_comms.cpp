// `kiln bench comms`: collective bandwidth of the communication layer, run under kiln launch.
// One JSON line per size on rank 0's stdout with algbw_GBps and busbw_GBps as nccl-tests
// computes them (algbw = S / time, S the op's data size: the all_reduce / broadcast tensor, the
// all_gather output, the reduce_scatter and all_to_all input; busbw = algbw x 2(n-1)/n for
// all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast), and a
// human table on stderr. The time of an iteration is the slowest rank's; the median is reported.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "cli/args.h"
#include "cli/bench.h"
#include "kiln/core/error.h"
#include "kiln/dist/backends.h"
#include "kiln/ops/ops.h"

namespace kiln::cli {
namespace {

// nccl-tests' sizes: 1K, 64M, 1G are binary; KB / MiB and the other units of parse_bytes too.
int64_t parse_comm_bytes(std::string s) {
  if (!s.empty() && (s.back() == 'K' || s.back() == 'M' || s.back() == 'G')) s += "iB";
  return parse_bytes(s);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t c = s.find(',', pos);
    out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

}  // namespace

int run_bench_comms(const Args& args) {
  std::string backend = "gloo", op = "all_reduce", bytes_list = "1M,64M", dtype_s = "f32";
  int64_t iters = 20, warmup = 3;
  double timeout_s = 600;
  ArgParser p("bench comms",
              "Bandwidth of a collective across the ranks of kiln launch (or torchrun): one JSON line per size\n"
              "on rank 0's stdout (algbw_GBps, busbw_GBps as nccl-tests computes them), a table on stderr.");
  p.option("--backend", &backend, "gloo|nccl", "gloo: CPU tensors; nccl: one CUDA device per rank")
      .option("--op", &op, "OP", "all_reduce, all_gather, reduce_scatter, all_to_all or broadcast")
      .option("--bytes", &bytes_list, "LIST", "comma-separated data sizes S (1K, 64M, 1G binary; or 5MB, 512MiB)")
      .option("--dtype", &dtype_s, "DTYPE", "f32, bf16, f16, f64, i32, i64 or u8")
      .option("--iters", &iters, "N", "timed iterations per size")
      .option("--warmup", &warmup, "N", "untimed iterations per size")
      .option("--timeout", &timeout_s, "SECONDS", "per-operation timeout")
      .epilog("\nexample: kiln launch --nproc-per-node 4 --master-port 0 -- kiln bench comms --op all_gather --bytes 1M,64M\n");
  if (!p.parse(args)) return 0;
  const std::vector<std::string> known = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"};
  KILN_CHECK(std::find(known.begin(), known.end(), op) != known.end(), "bench comms: --op '", op,
             "' (expected all_reduce, all_gather, reduce_scatter, all_to_all or broadcast)");
  KILN_CHECK(backend == "gloo" || backend == "nccl", "bench comms: --backend '", backend, "' (expected gloo or nccl)");
  KILN_CHECK(iters >= 1 && iters <= 100000, "bench comms: --iters ", iters, " out of range [1, 100000]");
  KILN_CHECK(warmup >= 0 && warmup <= 1000, "bench comms: --warmup ", warmup, " out of range [0, 1000]");
  KILN_CHECK(timeout_s > 0, "bench comms: --timeout ", timeout_s, " must be positive");
  const DType dt = parse_dtype(dtype_s);
  dist::CommOptions opt;
  opt.timeout = dist::Millis(static_cast<int64_t>(timeout_s * 1000));
  auto comm = dist::init_world(backend, "bench", opt);
  const int n = comm->size();
  const Device dev = backend == "nccl" ? cuda(dist::DistEnv::from_env().local_rank) : kCPU;
  const size_t item = itemsize(dt);
  const bool lead = comm->rank() == 0;
  if (lead)
    std::fprintf(stderr, "%-15s %6s %12s %12s %12s %12s\n", "op", "ranks", "bytes", "time_us", "algbw_GB/s",
                 "busbw_GB/s");
  for (const auto& text : split_list(bytes_list)) {
    const int64_t S = parse_comm_bytes(text);
    int64_t elems = S / static_cast<int64_t>(item);
    if (op != "all_reduce" && op != "broadcast") elems -= elems % n;  // divisible by the world size
    KILN_CHECK(elems > 0, "bench comms: --bytes ", text, " holds no whole ", dtype_name(dt), " element per rank");
    const int64_t chunk = op == "all_gather" || op == "reduce_scatter" ? elems / n : elems;
    Tensor big = zeros({elems}, dt, dev), small = zeros({chunk}, dt, dev);
    auto once = [&] {
      dist::WorkPtr w;
      if (op == "all_reduce") w = comm->all_reduce(big, dist::ReduceOp::sum);
      else if (op == "all_gather") w = comm->all_gather_single(big, small);
      else if (op == "reduce_scatter") w = comm->reduce_scatter_single(small, big, dist::ReduceOp::sum);
      else if (op == "all_to_all") w = comm->all_to_all_single(small, big);
      else w = comm->broadcast(big, 0);
      w->wait();
    };
    for (int64_t i = 0; i < warmup; ++i) once();
    comm->barrier()->wait();
    std::vector<double> secs(static_cast<size_t>(iters));
    for (int64_t i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      once();
      secs[static_cast<size_t>(i)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    // The slowest rank's time per iteration (on the backend's device: NCCL takes no CPU tensor).
    Tensor times = from_vector<double>(secs, {iters}).to(dev);
    comm->all_reduce(times, dist::ReduceOp::max)->wait();
    const double t = median(times.to(kCPU).to_vector<double>());
    const double data = static_cast<double>(elems) * static_cast<double>(item);
    const double algbw = data / t / 1e9;
    const double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : op == "broadcast" ? 1.0 : double(n - 1) / n;
    if (!lead) continue;
    json::Value r = json::Value::object();
    r["bench"] = "comms";
    r["impl"] = "kiln";
    r["backend"] = backend;
    r["device"] = dev.str();
    r["op"] = op;
    r["world_size"] = n;
    r["bytes"] = static_cast<int64_t>(data);
    json::Value shape = json::Value::array();
    shape.push_back(elems);
    r["shape"] = shape;
    r["dtype"] = dtype_name(dt);
    r["iters"] = iters;
    r["ms_median"] = t * 1e3;
    r["algbw_GBps"] = algbw;
    r["busbw_GBps"] = algbw * factor;
    r["peak_bytes"] = static_cast<int64_t>(big.nbytes() + small.nbytes());
    print_record(r);
    std::fprintf(stderr, "%-15s %6d %12lld %12.1f %12.3f %12.3f\n", op.c_str(), n, static_cast<long long>(data), t * 1e6,
                 algbw, algbw * factor);
  }
  return 0;
}

}  // namespace kiln::cli
