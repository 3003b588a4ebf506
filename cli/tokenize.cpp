// `kiln tokenize`: turns text files into a token file that `kiln train --data FILE.bin` reads
// (llm.c's header format plus a sidecar FILE.bin.json naming the vocabulary and the
// tokenizer; kiln/data/token_file.h). Each input file is one document: <bos> ids <eos>.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/data/dataset.h"
#include "kiln/data/token_file.h"
#include "kiln/data/tokenizer.h"

namespace kiln::cli {

namespace fs = std::filesystem;

int run_tokenize(const Args& args) {
  std::string spec = "byte", out;
  int64_t vocab = 0;
  std::vector<std::string> files;
  Args rest;
  for (size_t i = 0; i < args.size(); ++i) {  // FILE... anywhere among the flags
    if (!args[i].empty() && args[i][0] == '-') {
      rest.push_back(args[i]);
      if (args[i].find('=') == std::string::npos && i + 1 < args.size() && args[i] != "--help" && args[i] != "-h")
        rest.push_back(args[++i]);
    } else {
      files.push_back(args[i]);
    }
  }
  ArgParser p("tokenize", "Tokenize text files into a token file for kiln train --data FILE.bin (llm.c's format:\n"
              "a 256-int32 header, uint16 ids up to a vocabulary of 65536, else uint32; and FILE.bin.json\n"
              "with the vocabulary and the tokenizer). Each FILE is one document: <bos> text <eos>.");
  p.option("--tokenizer", &spec, "SPEC", "'byte' (built in) or a SentencePiece tokenizer.model");
  p.option("--out", &out, "FILE.bin", "the token file to write (and FILE.bin.json)");
  p.option("--vocab", &vocab, "N", "the vocabulary to record (0: the tokenizer's; at least the tokenizer's)");
  p.epilog("FILE... are the text files, in order.\nexample:\n"
           "  kiln tokenize --tokenizer tokenizer.model train.txt --out train.bin\n"
           "  kiln train --data train.bin --preset tiny\n");
  if (!p.parse(rest)) return 0;
  KILN_CHECK(!files.empty(), "tokenize: no input FILE given");
  KILN_CHECK(!out.empty(), "tokenize: --out FILE.bin is required");
  KILN_CHECK(data::is_token_data(out) && out.rfind("random:", 0) != 0, "tokenize: --out '", out,
             "' must end in .bin (kiln train reads .bin files as token ids)");
  std::unique_ptr<data::Tokenizer> tok = data::load_tokenizer(spec);
  KILN_CHECK(vocab >= 0, "tokenize: --vocab=", vocab, " must be >= 0");
  if (vocab == 0) vocab = tok->vocab_size();
  KILN_CHECK(vocab >= tok->vocab_size(), "tokenize: --vocab=", vocab, " is smaller than the tokenizer's ",
             tok->vocab_size(), " ids");
  std::vector<std::string> texts;
  for (const auto& f : files) {
    std::error_code ec;
    KILN_CHECK(fs::is_regular_file(f, ec), "tokenize: '", f, "' is not a regular file");
    std::ifstream in(f, std::ios::binary);
    KILN_CHECK(in.good(), "tokenize: cannot open '", f, "'");
    texts.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<std::string_view> views(texts.begin(), texts.end());
  const data::TokenStream s = data::tokenize_documents(views, *tok);
  // The sidecar names the tokenizer by an absolute path (a relative one is read from the sidecar's folder).
  const std::string tok_name = spec == "byte" ? spec : fs::absolute(spec).lexically_normal().string();
  data::write_token_file(out, s.tokens, vocab, tok_name);
  std::fprintf(stderr, "wrote %zu tokens of %zu document(s) (vocabulary %lld, %s ids) to %s and %s.json\n",
               s.tokens.size(), files.size(), static_cast<long long>(vocab), vocab <= 65536 ? "uint16" : "uint32",
               out.c_str(), out.c_str());
  return 0;
}

}  // namespace kiln::cli
