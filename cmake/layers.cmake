# The library's layers (docs/design.md, "Layers"; tests/core/layers_test.cpp checks the same table
# on the #includes): one static library kiln_<folder> per folder of kiln/, linked PUBLIC to every
# folder of a lower rank and to nothing at its own rank or above, so a call that runs up or sideways
# has nothing to resolve against. kiln_add_layer_link_checks() makes that a build error: each
# layer's objects are linked once more into a shared library with -Wl,--no-undefined against the
# layers below it, so an upward reference fails the build naming the symbol and the object.
#
# Rank, then the folders of that rank (siblings, comma-separated).
set(KILN_LAYER_RANKS
  "0:core"
  "1:autograd"
  "2:kernels"
  "3:ops"
  "4:io"
  "5:telemetry,jit"
  "6:attention,loss,data,dist"
  "7:nn,optim"
  "8:parallel"
  "9:train")

# kiln_add_layers(sources): one STATIC library per folder from the filtered source list, each
# linked to the layers of lower ranks; `kiln` (INTERFACE) links them all.
function(kiln_add_layers sources)
  set(below "")
  set(all "")
  foreach(entry IN LISTS KILN_LAYER_RANKS)
    string(REGEX REPLACE "^[0-9]+:" "" folders "${entry}")
    string(REPLACE "," ";" folders "${folders}")
    set(rank_targets "")
    foreach(folder IN LISTS folders)
      set(layer_sources "")
      foreach(src IN LISTS sources)
        file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
        if(rel MATCHES "^kiln/${folder}/")
          list(APPEND layer_sources ${src})
        endif()
      endforeach()
      set(t kiln_${folder})
      add_library(${t} STATIC ${layer_sources})
      target_link_libraries(${t} PUBLIC ${below})
      if(KILN_CUDA)
        target_compile_options(${t} PRIVATE
          $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 -gencode=arch=compute_90a,code=sm_90a
            --expt-relaxed-constexpr --extended-lambda -Xcompiler=-fopenmp ${KILN_CUDA_DEVICE_INFO}>)
        # CUDA sources inherit CXX_STANDARD(_REQUIRED) otherwise, which CMake 3.25 refuses for nvcc 13.
        set_target_properties(${t} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF CUDA_RESOLVE_DEVICE_SYMBOLS ON
                              CUDA_STANDARD_REQUIRED OFF)
      endif()
      set_property(TARGET ${t} PROPERTY KILN_LAYERS_BELOW "${below}")
      list(APPEND rank_targets ${t})
      list(APPEND all ${t})
    endforeach()
    list(APPEND below ${rank_targets})
  endforeach()
  # A source under kiln/ in no layer's folder would be left out of every library: refuse it.
  foreach(src IN LISTS sources)
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
    string(REGEX MATCH "^kiln/([a-z_]+)/" m "${rel}")
    if(NOT CMAKE_MATCH_1 OR NOT TARGET kiln_${CMAKE_MATCH_1})
      message(FATAL_ERROR "${rel}: kiln/${CMAKE_MATCH_1}/ is in no layer: add it to KILN_LAYER_RANKS "
                          "(cmake/layers.cmake), tests/core/layers_test.cpp and docs/design.md")
    endif()
  endforeach()
  add_library(kiln INTERFACE)
  target_link_libraries(kiln INTERFACE ${all})
  set_property(GLOBAL PROPERTY KILN_LAYER_TARGETS "${all}")
endfunction()

# One shared library per layer, from that layer's objects alone, linked with --no-undefined to the
# layers below (and their external libraries): built with `all`, so an arrow that runs up breaks
# the build. Left out under the sanitizers (their runtimes are not linked into shared objects).
option(KILN_LAYER_LINK_CHECK "Link each layer alone against the layers below it (an upward call fails the build)" ON)
function(kiln_add_layer_link_checks)
  if(NOT KILN_LAYER_LINK_CHECK OR KILN_SANITIZE)
    return()
  endif()
  get_property(all GLOBAL PROPERTY KILN_LAYER_TARGETS)
  foreach(t IN LISTS all)
    get_property(below TARGET ${t} PROPERTY KILN_LAYERS_BELOW)
    add_library(${t}_link_check SHARED $<TARGET_OBJECTS:${t}>)
    # The layer's own external libraries (PUBLIC on it) and the layers below with theirs.
    get_property(own TARGET ${t} PROPERTY INTERFACE_LINK_LIBRARIES)
    list(REMOVE_ITEM own ${below})
    target_link_libraries(${t}_link_check PRIVATE ${below} ${own})
    target_link_options(${t}_link_check PRIVATE "LINKER:--no-undefined")
    if(KILN_CUDA)
      set_target_properties(${t}_link_check PROPERTIES CUDA_RESOLVE_DEVICE_SYMBOLS OFF)
    endif()
    set_target_properties(${t}_link_check PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/layer_link_check)
  endforeach()
endfunction()
