// What the generate front ends share (kiln/nn/generate.h): the options from their flags and the
// prompt's ids from a tokenizer.
#include <gtest/gtest.h>

#include "kiln/core/error.h"
#include "kiln/nn/generate.h"

using namespace kiln;

TEST(GenerateFrontEnd, OptionsAreValidatedAndNameTheCaller) {
  const nn::GenerateOptions o = nn::generate_options(17, 0.5, 3, 0.25, 9, "test");
  EXPECT_EQ(o.max_new_tokens, 17);
  EXPECT_EQ(o.temperature, 0.5);
  EXPECT_EQ(o.top_k, 3);
  EXPECT_EQ(o.top_p, 0.25);
  EXPECT_EQ(o.seed, 9u);
  try {
    nn::generate_options(1, 0.8, 0, 1.0, -4, "kiln.generate");
    FAIL() << "a negative seed was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kiln.generate: seed must be >= 0, got -4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(nn::generate_options(1, 0.8, 0, 1.5, 0, "x"), Error);  // top_p out of (0, 1]
  EXPECT_THROW(nn::generate_options(-1, 0.8, 0, 1.0, 0, "x"), Error);
}

TEST(GenerateFrontEnd, ThePromptStartsWithBosAndSetsEos) {
  const data::ByteTokenizer tok;
  nn::GenerateOptions o;
  const std::vector<int32_t> ids = nn::encode_prompt(tok, "h\xc3\xa9", o);
  std::vector<int32_t> want;
  if (tok.bos_id() >= 0) want.push_back(tok.bos_id());
  for (int32_t t : tok.encode("h\xc3\xa9")) want.push_back(t);
  ASSERT_EQ(want.size(), tok.bos_id() >= 0 ? 4u : 3u);
  EXPECT_EQ(ids, want);
  EXPECT_EQ(o.eos_id, tok.eos_id());
}
