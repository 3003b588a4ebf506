// `kiln convert IN OUT.safetensors [--shard-size 5GB]`: converts anything kiln::io::load reads
// (safetensors, sharded index or folder, PyTorch zip checkpoint) to safetensors. Raw dtypes and
// metadata are copied through unchanged. With --shard-size, OUT is a folder that receives a
// Hugging Face sharded checkpoint (model-0000k-of-0000n.safetensors + index).
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/io/load.h"
#include "kiln/io/sharded.h"

namespace kiln::cli {
namespace {

namespace fs = std::filesystem;

// Refuses an OUT that would replace a file the conversion reads (the input itself, or, for a
// sharded OUT, a checkpoint file of the input in that folder): the input would be lost.
void check_out_spares_input(const std::string& in, const std::string& out, bool sharded) {
  for (const std::string& f : io::checkpoint_files(in)) {
    const fs::path file = fs::absolute(f);
    std::error_code ec;  // equivalent() is false (with ec set) when OUT does not exist yet
    const bool replaced = sharded ? io::is_sharded_file_name(file.filename().string()) &&
                                        fs::equivalent(file.parent_path(), out, ec)
                                  : fs::equivalent(file, out, ec);
    KILN_CHECK(!replaced, "convert: OUT ", out, sharded ? " holds the input file " : " is the input file ", f,
               ", which writing would replace; choose another OUT");
  }
}

}  // namespace

int run_convert(const Args& args) {
  std::string in, out, shard_size;
  ArgParser p("convert", "Convert a checkpoint (safetensors, sharded index or folder, PyTorch .pt/.bin zip) to\n"
                         "safetensors. Writes atomically; tensors stream one at a time.");
  p.positional("IN", &in, "checkpoint file, index or folder");
  p.positional("OUT", &out, "output .safetensors file (a folder with --shard-size)");
  p.option("--shard-size", &shard_size, "SIZE", "write a sharded checkpoint into folder OUT, shards of at most SIZE (e.g. 5GB)");
  p.epilog("examples:\n  kiln convert pytorch_model.bin model.safetensors\n  kiln convert ckpt/ out/ --shard-size 5GB");
  if (!p.parse(args)) return 0;
  io::Metadata metadata;
  io::StoredTensors tensors = io::load_stored(in, &metadata);
  // A checkpoint with no tensors is not a model (a pickle of other values, a sharded index whose
  // weight_map is empty): writing an empty file would pass for a conversion. A safetensors file
  // with none is valid (Python's safetensors writes and reads one) and is copied as it is.
  const io::FileFormat in_format = io::sniff_format(in);
  KILN_CHECK(!tensors.empty() || in_format == io::FileFormat::safetensors, "convert: ", in, " holds no tensors (",
             io::format_name(in_format), "); nothing to convert");
  check_out_spares_input(in, out, p.given("--shard-size"));
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes();
  if (p.given("--shard-size")) {
    const int64_t max = parse_bytes(shard_size);
    KILN_CHECK(max > 0, "convert: --shard-size must be positive, got '", shard_size, "'");
    auto files = io::save_sharded(out, tensors, static_cast<uint64_t>(max), metadata);
    std::printf("%s: %zu tensors, %llu bytes in %zu file(s)\n", out.c_str(), tensors.size(),
                static_cast<unsigned long long>(total), files.size());
    return 0;
  }
  io::save_safetensors(out, tensors, metadata);
  std::printf("%s: %zu tensors, %llu bytes\n", out.c_str(), tensors.size(), static_cast<unsigned long long>(total));
  return 0;
}

}  // namespace kiln::cli
