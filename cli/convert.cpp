// `kiln convert IN OUT.safetensors [--shard-size 5GB]`: converts anything kiln::io::load reads
// (safetensors, sharded index or folder, PyTorch zip checkpoint) to safetensors. Raw dtypes and
// metadata are copied through unchanged. With --shard-size, OUT is a folder that receives a
// Hugging Face sharded checkpoint (model-0000k-of-0000n.safetensors + index).
// `kiln convert RUN_DIR OUT_DIR --hf [--step N] [--force]`: consolidates a kiln checkpoint
// (sharded by kiln train --nproc N, or one-process) into the Hugging Face layout
// (train/hf_export.h).
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/io/load.h"
#include "kiln/io/sharded.h"
#include "kiln/train/hf_export.h"

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
  bool hf = false, force = false;
  int64_t step = -1;
  ArgParser p("convert", "Convert a checkpoint (safetensors, sharded index or folder, PyTorch .pt/.bin zip) to\n"
                         "safetensors. Writes atomically; tensors stream one at a time.\n\n"
                         "With --hf: IN is a kiln train run folder (its `latest` checkpoint) or a checkpoint\n"
                         "folder (step-N), sharded (kiln train --nproc N: shard-*.safetensors + sharded.index.json,\n"
                         "any N) or one-process. OUT becomes a folder that transformers' LlamaForCausalLM\n"
                         ".from_pretrained(OUT) loads: config.json, model.safetensors (f32, Hugging Face names,\n"
                         "the parameters consolidated from every rank's chunks) and the tokenizer's files when the\n"
                         "checkpoint has them; no optimizer state. The whole checkpoint is checked first (a chunk\n"
                         "missing, overlapping chunks, a shard file missing or cut short: an error naming the file\n"
                         "and the tensor); OUT is written as a temporary sibling and renamed into place, so a\n"
                         "failure leaves OUT as it was. A non-empty OUT is refused unless --force.");
  p.positional("IN", &in, "checkpoint file, index or folder (--hf: run folder or checkpoint folder)");
  p.positional("OUT", &out, "output .safetensors file (a folder with --shard-size or --hf)");
  p.option("--shard-size", &shard_size, "SIZE", "write a sharded checkpoint into folder OUT, shards of at most SIZE (e.g. 5GB)");
  p.flag("--hf", &hf, "consolidate a kiln train checkpoint (sharded or not) into the Hugging Face layout in folder OUT");
  p.option("--step", &step, "N", "with --hf: the checkpoint IN/step-N instead of IN's latest").without_default();
  p.flag("--force", &force, "with --hf: replace a non-empty OUT (once the new one is complete)");
  p.epilog("examples:\n  kiln convert pytorch_model.bin model.safetensors\n  kiln convert ckpt/ out/ --shard-size 5GB\n"
           "  kiln convert runs/x runs/x-hf --hf              # the latest checkpoint of run runs/x\n"
           "  kiln convert runs/x runs/x-hf --hf --step 200   # runs/x/step-200\n"
           "  python -c \"import transformers; transformers.LlamaForCausalLM.from_pretrained('runs/x-hf')\"");
  if (!p.parse(args)) return 0;
  KILN_CHECK(hf || (!p.given("--step") && !force), "convert: --step and --force go with --hf");
  if (hf) {
    KILN_CHECK(!p.given("--shard-size"), "convert: --shard-size does not go with --hf (OUT gets one model.safetensors)");
    KILN_CHECK(!p.given("--step") || step >= 0, "convert: --step must be >= 0, got ", step);
    train::HfExportOptions o;
    o.step = step;
    o.force = force;
    const train::HfExportResult r = train::export_hf(in, out, o);
    if (!r.note.empty()) std::fprintf(stderr, "%s\n", r.note.c_str());
    std::printf("%s: Hugging Face checkpoint of %s (%s), %lld parameters%s\n", out.c_str(), r.checkpoint.c_str(),
                r.sharded ? ("sharded over " + std::to_string(r.world_size) + " rank(s)").c_str() : "one process",
                static_cast<long long>(r.parameters), r.tokenizer ? ", with its tokenizer" : " (no tokenizer files in the checkpoint)");
    return 0;
  }
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
