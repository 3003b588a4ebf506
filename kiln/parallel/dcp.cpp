// Sharded checkpoints: the writer (per-rank safetensors files, rank 0's index, barriers and
// the rename) and the reader (a plan of every chunk, checked whole, then the copies of the
// chunks that intersect each target's rows).
#include "kiln/parallel/dcp.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>

#include "kiln/autograd/grad_mode.h"
#include "kiln/io/file.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"

namespace kiln::parallel {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRowsKey = "kiln.row_begin";  // a shard file's metadata: {name: first row}

std::string shard_file_name(int r, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d.safetensors", r, n);
  return buf;
}

void fsync_path(const std::string& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

json::Value shape_json(const Shape& s) {
  json::Value a = json::Value::array();
  for (int64_t d : s) a.as_array().push_back(d);
  return a;
}

const json::Value& member(const json::Value& v, const char* key, const std::string& what) {
  const json::Value* m = v.find(key);
  KILN_CHECK(m != nullptr, what, " has no \"", key, "\"");
  return *m;
}

Shape json_shape(const json::Value& v, const std::string& what) {
  Shape s;
  for (const auto& d : v.as_array(what)) {
    const int64_t x = d.as_int(what);
    KILN_CHECK(x >= 0, what, ": negative size ", x);
    s.push_back(x);
  }
  return s;
}

// Runs `fn` on this rank, then agrees with every rank on whether all succeeded (one all-reduce),
// so that a rank's failure ends the save on every rank instead of leaving them at a barrier.
void all_or_nothing(dist::Communicator& comm, const char* phase, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
  }
  Tensor flag = from_vector<int32_t>({error.empty() ? 0 : 1}, {1}, comm.device());  // NCCL: a CUDA tensor
  comm.all_reduce(flag, dist::ReduceOp::max)->wait();
  if (!error.empty()) fail(error);
  KILN_CHECK(flag.to_vector<int32_t>()[0] == 0, "save_sharded: another rank failed while ", phase,
             " (its own error names the cause); the previous checkpoint is unchanged");
}

// ---- the read plan ----

struct Chunk {
  int64_t row = 0, rows = 0;  // global first row, row count
  std::string file;            // path
  uint64_t first = 0, end = 0;  // byte range in the file
};

struct PlanTensor {
  Shape shape;
  std::string dtype;
  std::vector<Chunk> chunks;
};

struct Plan {
  std::string where;  // the index (or the folder) for messages
  std::map<std::string, PlanTensor> tensors;
  json::Value metadata = json::Value::object();
  std::map<std::string, std::shared_ptr<io::SafetensorsFile>> files;  // opened and checked
};

std::shared_ptr<io::SafetensorsFile> open_file(Plan& plan, const std::string& path, const std::string& tensor) {
  auto it = plan.files.find(path);
  if (it != plan.files.end()) return it->second;
  KILN_CHECK(fs::exists(path), "checkpoint ", plan.where, ": tensor '", tensor, "' has a chunk in ", path,
             ", which does not exist");
  try {
    auto f = std::make_shared<io::SafetensorsFile>(io::SafetensorsFile::open(path));
    plan.files.emplace(path, f);
    return f;
  } catch (const Error& e) {
    fail("checkpoint ", plan.where, ": ", path, " (holding tensor '", tensor, "') is unreadable: ", e.what());
  }
}

// Checks that the chunks of every tensor cover its rows exactly once, and that each chunk is in
// its file, as the index says.
void check_plan(Plan& plan) {
  for (auto& [name, t] : plan.tensors) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    std::sort(t.chunks.begin(), t.chunks.end(), [](const Chunk& a, const Chunk& b) { return a.row < b.row; });
    int64_t next = 0;
    const Chunk* prev = nullptr;
    for (const Chunk& c : t.chunks) {
      KILN_CHECK(c.row >= next, "checkpoint ", plan.where, ": chunks of tensor '", name, "' overlap at rows [", c.row,
                 ", ", std::min(next, c.row + c.rows), ") (in ", prev ? prev->file : c.file, " and ", c.file, ")");
      KILN_CHECK(c.row == next, "checkpoint ", plan.where, ": rows [", next, ", ", c.row, ") of tensor '", name,
                 "' are in no chunk (a chunk is missing)");
      next = c.row + c.rows;
      prev = &c;
    }
    KILN_CHECK(next == rows, "checkpoint ", plan.where, ": rows [", next, ", ", rows, ") of tensor '", name,
               "' are in no chunk (a chunk is missing)");
    for (const Chunk& c : t.chunks) {
      auto f = open_file(plan, c.file, name);
      const io::HeaderEntry* e = nullptr;
      for (const auto& x : f->entries())
        if (x.name == name) e = &x;
      KILN_CHECK(e != nullptr, "checkpoint ", plan.where, ": ", c.file, " has no tensor '", name,
                 "' (the index says it holds rows [", c.row, ", ", c.row + c.rows, "))");
      Shape want = t.shape;
      if (!want.empty()) want[0] = c.rows;
      const Shape got(e->shape.begin(), e->shape.end());
      KILN_CHECK(got == want && t.dtype == e->dtype->name, "checkpoint ", plan.where, ": tensor '", name, "' in ",
                 c.file, " is ", e->dtype->name, " ", shape_str(got), ", the index says ", t.dtype, " ",
                 shape_str(want));
      const uint64_t first = 8 + f->header_bytes() + e->begin, end = 8 + f->header_bytes() + e->end;
      KILN_CHECK(c.end == 0 || (c.first == first && c.end == end), "checkpoint ", plan.where, ": tensor '", name,
                 "' is at bytes [", first, ", ", end, ") of ", c.file, ", the index says [", c.first, ", ", c.end, ")");
    }
  }
}

Plan read_index(const std::string& dir) {
  Plan plan;
  const std::string path = (fs::path(dir) / kShardedIndexFile).string();
  plan.where = path;
  json::Value idx;
  try {
    idx = json::parse(io::read_file_prefix(path, size_t(1) << 30));
  } catch (const Error& e) {
    fail("checkpoint ", path, ": ", e.what());
  }
  try {
    KILN_CHECK(idx.find("format") && idx.find("format")->as_string("format") == "kiln.sharded",
               "it is not a kiln sharded index (\"format\" is not \"kiln.sharded\")");
    if (const json::Value* m = idx.find("metadata")) plan.metadata = *m;
    const json::Value* ts = idx.find("tensors");
    KILN_CHECK(ts && ts->is_object(), "it has no \"tensors\" object");
    for (const auto& [name, v] : ts->as_object()) {
      const std::string what = "tensor '" + name + "'";
      PlanTensor t;
      t.shape = json_shape(member(v, "shape", what), what + " shape");
      t.dtype = member(v, "dtype", what).as_string(what + " dtype");
      for (const auto& c : member(v, "chunks", what).as_array(what + " chunks")) {
        const Shape off = json_shape(member(c, "offset", what + " chunk"), what + " chunk offset");
        const Shape cs = json_shape(member(c, "shape", what + " chunk"), what + " chunk shape");
        KILN_CHECK(off.size() == t.shape.size() && cs.size() == t.shape.size(), what, ": a chunk of rank ",
                   cs.size(), " in a tensor of rank ", t.shape.size());
        for (size_t d = 1; d < t.shape.size(); ++d)
          KILN_CHECK(off[d] == 0 && cs[d] == t.shape[d], what, ": a chunk at offset ", shape_str(off), " shape ",
                     shape_str(cs), " is not a block of whole rows of ", shape_str(t.shape));
        Chunk ch;
        ch.row = off.empty() ? 0 : off[0];
        ch.rows = cs.empty() ? 1 : cs[0];
        const std::string& file = member(c, "file", what + " chunk").as_string(what + " chunk file");
        KILN_CHECK(file.find('/') == std::string::npos && file != ".." && !file.empty(), what,
                   ": chunk file '", file, "' is not a file name in the checkpoint folder");
        ch.file = (fs::path(dir) / file).string();
        const auto& bytes = member(c, "bytes", what + " chunk").as_array(what + " chunk bytes");
        KILN_CHECK(bytes.size() == 2, what, ": chunk bytes must be [first, end]");
        ch.first = static_cast<uint64_t>(bytes[0].as_int());
        ch.end = static_cast<uint64_t>(bytes[1].as_int());
        KILN_CHECK(ch.end > 0, what, ": chunk bytes end at 0");
        t.chunks.push_back(std::move(ch));
      }
      plan.tensors.emplace(name, std::move(t));
    }
  } catch (const Error& e) {
    fail("checkpoint ", path, ": ", e.what());
  }
  return plan;
}

// kiln train's single-process checkpoint: every tensor of model.safetensors and
// optimizer.safetensors is one chunk.
Plan read_single(const std::string& dir) {
  Plan plan;
  plan.where = dir;
  for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string path = (fs::path(dir) / name).string();
    if (!fs::exists(path)) continue;
    auto f = open_file(plan, path, name);
    for (const auto& e : f->entries()) {
      PlanTensor t;
      t.shape.assign(e.shape.begin(), e.shape.end());
      t.dtype = e.dtype->name;
      Chunk c;
      c.rows = t.shape.empty() ? 1 : t.shape[0];
      c.file = path;
      t.chunks.push_back(c);
      KILN_CHECK(plan.tensors.emplace(e.name, std::move(t)).second, "checkpoint ", dir, ": tensor '", e.name,
                 "' is in both model.safetensors and optimizer.safetensors");
    }
  }
  const std::string ts = (fs::path(dir) / "trainer_state.json").string();
  if (fs::exists(ts)) {
    json::Value st = json::parse(io::read_file_prefix(ts, size_t(1) << 30));
    if (const json::Value* o = st.find("optimizer")) plan.metadata["optimizer"] = *o;
  }
  return plan;
}

Plan read_plan(const std::string& dir) {
  KILN_CHECK(io::is_directory(dir), "checkpoint: '", dir, "' is not a folder");
  Plan plan;
  if (fs::exists(fs::path(dir) / kShardedIndexFile)) plan = read_index(dir);
  else if (fs::exists(fs::path(dir) / "model.safetensors")) plan = read_single(dir);
  else fail("checkpoint: '", dir, "' has neither ", kShardedIndexFile, " nor model.safetensors");
  check_plan(plan);
  return plan;
}

}  // namespace

// ---- saving ----

namespace {
void save_sharded_phases(const std::string& dir, const std::string& tmp, dist::Communicator& comm,
                         const std::vector<ShardedTensor>& tensors, const json::Value& metadata,
                         const std::function<void(const std::string& tmp)>& rank0_files);
}  // namespace

void save_sharded(const std::string& dir, dist::Communicator& comm, const std::vector<ShardedTensor>& tensors,
                  const json::Value& metadata, const std::function<void(const std::string& tmp)>& rank0_files) {
  const int R = comm.rank();
  const std::string tmp = dir + ".tmp-sharded";
  try {
    save_sharded_phases(dir, tmp, comm, tensors, metadata, rank0_files);
  } catch (...) {
    std::error_code ec;
    if (R == 0) fs::remove_all(tmp, ec);  // every rank has stopped writing: the phases agreed
    throw;
  }
}

namespace {
void save_sharded_phases(const std::string& dir, const std::string& tmp, dist::Communicator& comm,
                         const std::vector<ShardedTensor>& tensors, const json::Value& metadata,
                         const std::function<void(const std::string& tmp)>& rank0_files) {
  const int N = comm.size(), R = comm.rank();
  all_or_nothing(comm, "preparing the folder", [&] {
    if (R != 0) return;
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    KILN_CHECK(!ec, "save_sharded: cannot create ", tmp, ": ", ec.message());
  });
  all_or_nothing(comm, "writing its shard file", [&] {
    io::TensorMap local;
    json::Value rows = json::Value::object();
    for (const auto& t : tensors) {
      KILN_CHECK(!t.global_shape.empty() && t.local.dim() == static_cast<int64_t>(t.global_shape.size()) &&
                     t.row_begin >= 0 && t.row_begin + t.local.size(0) <= t.global_shape[0],
                 "save_sharded: tensor '", t.name, "' holds ", t.local.shape(), " at row ", t.row_begin, " of ",
                 shape_str(t.global_shape));
      for (size_t d = 1; d < t.global_shape.size(); ++d)
        KILN_CHECK(t.local.size(static_cast<int64_t>(d)) == t.global_shape[d], "save_sharded: tensor '", t.name,
                   "' holds ", t.local.shape(), ", not whole rows of ", shape_str(t.global_shape));
      if (t.local.size(0) == 0) continue;  // no rows here: no chunk
      Tensor x = t.local.detach();
      if (!x.is_cpu()) x = x.to(kCPU);
      local.emplace_back(t.name, x.contiguous());
      rows[t.name] = t.row_begin;
    }
    std::sort(local.begin(), local.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    io::save_safetensors((fs::path(tmp) / shard_file_name(R, N)).string(), local, {{kRowsKey, rows.dump()}});
  });
  all_or_nothing(comm, "rank 0 wrote the index and renamed the folder", [&] {
    if (R != 0) return;
    json::Value ts = json::Value::object();
    for (const auto& t : tensors) {
      json::Value& e = ts[t.name];
      e["shape"] = shape_json(t.global_shape);
      e["dtype"] = io::format_dtype_name(t.local.dtype());
      e["chunks"] = json::Value::array();
    }
    for (int r = 0; r < N; ++r) {
      const std::string file = shard_file_name(r, N);
      const io::SafetensorsFile f = io::SafetensorsFile::open((fs::path(tmp) / file).string());
      auto it = f.metadata().find(kRowsKey);
      KILN_CHECK(it != f.metadata().end(), "save_sharded: ", file, " has no ", kRowsKey, " metadata");
      const json::Value rows = json::parse(it->second);
      for (const auto& e : f.entries()) {
        json::Value* t = ts.find(e.name) ? &ts[e.name] : nullptr;
        KILN_CHECK(t != nullptr, "save_sharded: rank ", r, " saved tensor '", e.name, "', which rank 0 does not have");
        json::Value c = json::Value::object();
        Shape off(e.shape.size(), 0);
        off[0] = member(rows, e.name.c_str(), file + " " + kRowsKey).as_int(e.name);
        c["offset"] = shape_json(off);
        c["shape"] = shape_json(Shape(e.shape.begin(), e.shape.end()));
        c["file"] = file;
        json::Value b = json::Value::array();
        b.as_array().push_back(static_cast<int64_t>(8 + f.header_bytes() + e.begin));
        b.as_array().push_back(static_cast<int64_t>(8 + f.header_bytes() + e.end));
        c["bytes"] = b;
        (*t)["chunks"].as_array().push_back(c);
      }
    }
    json::Value idx = json::Value::object();
    idx["format"] = "kiln.sharded";
    idx["version"] = 1;
    idx["world_size"] = N;
    idx["metadata"] = metadata;
    idx["tensors"] = ts;
    {
      io::AtomicWriter w((fs::path(tmp) / kShardedIndexFile).string());
      const std::string text = idx.dump(1) + "\n";
      w.write(text.data(), text.size());
      w.commit();
    }
    if (rank0_files) rank0_files(tmp);
    for (const auto& e : fs::directory_iterator(tmp)) fsync_path(e.path().string());
    fsync_path(tmp);
    std::error_code ec;
    if (fs::exists(dir)) {
      const std::string old = dir + ".old-sharded";
      fs::remove_all(old, ec);
      fs::rename(dir, old, ec);
      KILN_CHECK(!ec, "save_sharded: cannot move the previous ", dir, " aside: ", ec.message());
      fs::rename(tmp, dir, ec);
      KILN_CHECK(!ec, "save_sharded: cannot rename ", tmp, " to ", dir, ": ", ec.message());
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, dir, ec);
      KILN_CHECK(!ec, "save_sharded: cannot rename ", tmp, " to ", dir, ": ", ec.message());
    }
    fsync_path(fs::path(dir).parent_path().empty() ? "." : fs::path(dir).parent_path().string());
  });
}
}  // namespace

// ---- loading ----

std::vector<CheckpointEntry> checkpoint_entries(const std::string& dir) {
  Plan plan = read_plan(dir);
  std::vector<CheckpointEntry> out;
  for (const auto& [name, t] : plan.tensors) out.push_back({name, t.shape, t.dtype});
  return out;
}

json::Value load_sharded(const std::string& dir, std::vector<ShardedTensor>& targets) {
  Plan plan = read_plan(dir);
  struct Copy {
    Tensor dst, src;
  };
  std::vector<Copy> copies;
  for (auto& t : targets) {
    auto it = plan.tensors.find(t.name);
    KILN_CHECK(it != plan.tensors.end(), "checkpoint ", plan.where, ": no tensor '", t.name, "'");
    const PlanTensor& p = it->second;
    KILN_CHECK(p.shape == t.global_shape, "checkpoint ", plan.where, ": tensor '", t.name, "' is ",
               shape_str(p.shape), ", expected ", shape_str(t.global_shape));
    KILN_CHECK(t.local.defined() && t.local.is_contiguous() && t.local.dim() >= 1, "load_sharded: target '", t.name,
               "' must be a defined contiguous tensor");
    const int64_t lo = t.row_begin, hi = t.row_begin + t.local.size(0);
    for (const Chunk& c : p.chunks) {
      const int64_t a = std::max(lo, c.row), b = std::min(hi, c.row + c.rows);
      if (a >= b) continue;
      const auto f = plan.files.at(c.file);
      for (const auto& e : f->entries()) {
        if (e.name != t.name) continue;
        io::StoredTensor st = f->tensor(e);
        KILN_CHECK(!st.raw(), "checkpoint ", c.file, ": tensor '", t.name, "' has dtype ", p.dtype,
                   ", which kiln cannot load");
        copies.push_back({t.local.narrow(0, a - lo, b - a), st.data.narrow(0, a - c.row, b - a)});
      }
    }
  }
  // Everything was found and checked: now write.
  NoGradGuard ng;
  for (auto& c : copies) c.dst.copy_(c.src);
  return plan.metadata;
}

std::vector<std::pair<std::string, Tensor>> load_full(const std::string& dir) {
  std::vector<ShardedTensor> targets;
  for (const auto& e : checkpoint_entries(dir)) {
    const io::FormatDType* fd = io::find_format_dtype(e.dtype);
    KILN_CHECK(fd && fd->kiln, "checkpoint ", dir, ": tensor '", e.name, "' has dtype ", e.dtype,
               ", which kiln cannot load");
    targets.push_back({e.name, e.shape, 0, Tensor::empty(e.shape, *fd->kiln)});
  }
  load_sharded(dir, targets);
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& t : targets) out.emplace_back(t.name, t.local);
  return out;
}

// ---- FSDP models and their optimizers ----

namespace {

std::vector<ShardedTensor> param_targets(const FsdpModule& fsdp) {
  std::vector<ShardedTensor> out;
  for (const auto& s : fsdp.shard_infos())
    out.push_back({s.name, s.global_shape, s.row_begin, Tensor::empty(s.shard.shape(), s.shard.dtype())});
  return out;
}

void copy_into_shards(FsdpModule& fsdp, const std::vector<ShardedTensor>& loaded) {
  NoGradGuard ng;
  const auto infos = fsdp.shard_infos();
  for (size_t i = 0; i < infos.size(); ++i) infos[i].shard.detach().copy_(loaded[i].local);
}

}  // namespace

void save_checkpoint(const std::string& dir, const FsdpModule& fsdp, const optim::Optimizer& opt,
                     const std::function<void(const std::string& tmp)>& rank0_files) {
  std::vector<ShardedTensor> tensors;
  std::map<std::string, FsdpModule::ShardInfo> by_name;
  for (const auto& s : fsdp.shard_infos()) {
    tensors.push_back({s.name, s.global_shape, s.row_begin, s.shard.detach()});
    by_name.emplace(s.name, s);
  }
  optim::OptimizerState st = opt.state_dict();
  for (const auto& [name, t] : st.tensors) {
    const auto dot = name.find('.');
    auto it = dot == std::string::npos ? by_name.end() : by_name.find(name.substr(dot + 1));
    KILN_CHECK(it != by_name.end(), "save_checkpoint: optimizer tensor '", name,
               "' belongs to no parameter of the FSDP model (build the optimizer on named_shards())");
    tensors.push_back({name, it->second.global_shape, it->second.row_begin, t});
  }
  json::Value meta = json::Value::object();
  meta["optimizer"] = st.scalars;
  save_sharded(dir, *fsdp.communicator(), tensors, meta, rank0_files);
}

void load_model(const std::string& dir, FsdpModule& fsdp) {
  std::vector<ShardedTensor> targets = param_targets(fsdp);
  load_sharded(dir, targets);
  copy_into_shards(fsdp, targets);
}

void load_checkpoint(const std::string& dir, FsdpModule& fsdp, optim::Optimizer& opt) {
  std::vector<ShardedTensor> targets = param_targets(fsdp);
  const size_t nparams = targets.size();
  std::map<std::string, FsdpModule::ShardInfo> by_name;
  for (const auto& s : fsdp.shard_infos()) by_name.emplace(s.name, s);
  // The optimizer's buffers in the checkpoint: "<buffer>.<parameter>", shaped as its shard.
  for (const auto& e : checkpoint_entries(dir)) {
    if (by_name.count(e.name)) continue;
    const auto dot = e.name.find('.');
    auto it = dot == std::string::npos ? by_name.end() : by_name.find(e.name.substr(dot + 1));
    KILN_CHECK(it != by_name.end(), "checkpoint ", dir, ": tensor '", e.name,
               "' is neither a parameter of this model nor an optimizer buffer of one");
    const auto& s = it->second;
    targets.push_back({e.name, s.global_shape, s.row_begin, Tensor::empty(s.shard.shape(), DType::f32)});
  }
  const json::Value meta = load_sharded(dir, targets);
  const json::Value* scalars = meta.find("optimizer");
  KILN_CHECK(scalars != nullptr, "checkpoint ", dir, ": no optimizer state (a model-only checkpoint; use load_model)");
  optim::OptimizerState st;
  st.scalars = *scalars;
  for (size_t i = nparams; i < targets.size(); ++i) st.tensors.emplace_back(targets[i].name, targets[i].local);
  opt.load_state_dict(st);  // checks every entry before changing anything
  targets.resize(nparams);
  copy_into_shards(fsdp, targets);
}

}  // namespace kiln::parallel
