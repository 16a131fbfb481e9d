# Shared preamble of the stand-alone projects built against an installed superoffload
# (examples/libtorch_trainer, examples/jax_ffi, demo): include it right after project().
#
#   so_example_find_superoffload(<name>)   find_package(SuperOffload CONFIG), unless the
#                                          SuperOffload:: targets already exist (the project is
#                                          a subdirectory of the root project), and say which;
#                                          it asks for no version: the examples are built with
#                                          the release they ship with
#   so_example_warnings(<target> [flag...]) -Wall -Wextra and the flags, on GCC and Clang

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

macro(so_example_find_superoffload name)
  if(NOT TARGET SuperOffload::superoffload)
    find_package(SuperOffload CONFIG REQUIRED)
    message(STATUS "${name}: SuperOffload ${SuperOffload_VERSION} from ${SuperOffload_DIR}")
  endif()
endmacro()

function(so_example_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra ${ARGN})
  endif()
endfunction()
