# Embeds the default training corpus into the library: the project's own documentation and
# headers, concatenated at build time into a byte array (kiln/data/default_corpus.h).
function(kiln_embed_corpus target)
  set(out ${PROJECT_BINARY_DIR}/generated/kiln_default_corpus.cpp)
  file(GLOB_RECURSE corpus_files CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/*.md ${PROJECT_SOURCE_DIR}/kiln/*.h)
  list(SORT corpus_files)
  add_custom_command(OUTPUT ${out}
    COMMAND ${CMAKE_COMMAND} -DOUT=${out} "-DFILES=${corpus_files}" -P ${PROJECT_SOURCE_DIR}/cmake/embed_run.cmake
    DEPENDS ${corpus_files} ${PROJECT_SOURCE_DIR}/cmake/embed_run.cmake
    COMMENT "Embedding the default corpus" VERBATIM)
  target_sources(${target} PRIVATE ${out})
endfunction()
