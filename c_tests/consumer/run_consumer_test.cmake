# ctest's build_consumer: install the build tree into a fresh prefix (or use a prebuilt
# prefix), check the installed files, then build and run c_tests/consumer against it with
# find_package(SuperOffload <major.minor> CONFIG REQUIRED), from the prefix and from a
# moved copy of it; check that asking for the next minor version fails; check pkg-config.
#
# Variables (-D): SO_BUILD_DIR, SO_PREFIX (empty: install SO_BUILD_DIR), SO_WORK_DIR,
# SO_CONSUMER_SOURCE_DIR, SO_VERSION, SO_SONAME, SO_LIBDIR, SO_GENERATOR, SO_C_COMPILER,
# SO_PKG_CONFIG.
cmake_minimum_required(VERSION 3.22)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)$" _ "${SO_VERSION}")
set(major "${CMAKE_MATCH_1}")
set(minor "${CMAKE_MATCH_2}")
math(EXPR next_minor "${minor} + 1")

file(REMOVE_RECURSE "${SO_WORK_DIR}")
file(MAKE_DIRECTORY "${SO_WORK_DIR}")

if(SO_PREFIX)
  set(prefix "${SO_PREFIX}")
  message(STATUS "using the prebuilt prefix ${prefix}")
else()
  set(prefix "${SO_WORK_DIR}/prefix")
  run("${CMAKE_COMMAND}" --install "${SO_BUILD_DIR}" --prefix "${prefix}")
  message(STATUS "installed into ${prefix}")
endif()

# The installed files.
set(libdir "${prefix}/${SO_LIBDIR}")
foreach(f "${libdir}/libsuperoffload.so.${SO_VERSION}"
          "${libdir}/libsuperoffload.a"
          "${prefix}/include/superoffload.h"
          "${prefix}/bin/superoffload-bench"
          "${libdir}/cmake/SuperOffload/SuperOffloadConfig.cmake"
          "${libdir}/cmake/SuperOffload/SuperOffloadConfigVersion.cmake"
          "${libdir}/pkgconfig/superoffload.pc")
  if(NOT EXISTS "${f}")
    message(FATAL_ERROR "not installed: ${f}")
  endif()
endforeach()
foreach(link "${SO_SONAME}" "libsuperoffload.so")
  if(NOT IS_SYMLINK "${libdir}/${link}")
    message(FATAL_ERROR "${libdir}/${link} is not a symlink")
  endif()
endforeach()
# The C++ wrapper, where it is installed: the umbrella header and every topic header it
# includes (the source tree's umbrella names them; superoffload/torch.hpp is not among them:
# it is installed with the component torch).
if(EXISTS "${prefix}/include/superoffload.hpp")
  file(STRINGS "${SO_CONSUMER_SOURCE_DIR}/../../include/superoffload.hpp" include_lines
       REGEX "^#include \"superoffload/[a-z_]+\\.hpp\"")
  set(topic_headers "")
  foreach(line IN LISTS include_lines)
    string(REGEX REPLACE "^#include \"(superoffload/[a-z_]+\\.hpp)\".*" "\\1" h "${line}")
    list(APPEND topic_headers "${h}")
  endforeach()
  if(NOT topic_headers)
    message(FATAL_ERROR "no topic headers found in ${SO_CONSUMER_SOURCE_DIR}/../../include/superoffload.hpp")
  endif()
  foreach(h IN LISTS topic_headers)
    if(NOT EXISTS "${prefix}/include/${h}")
      message(FATAL_ERROR "not installed: ${prefix}/include/${h} (superoffload.hpp includes it)")
    endif()
  endforeach()
endif()
file(READ_SYMLINK "${libdir}/${SO_SONAME}" target)
if(NOT target STREQUAL "libsuperoffload.so.${SO_VERSION}")
  message(FATAL_ERROR "${SO_SONAME} -> ${target}")
endif()
file(READ_SYMLINK "${libdir}/libsuperoffload.so" target)
if(NOT target STREQUAL "${SO_SONAME}")
  message(FATAL_ERROR "libsuperoffload.so -> ${target}")
endif()
# The link is named after the SONAME that the installed library carries.
run(readelf -d "${libdir}/libsuperoffload.so.${SO_VERSION}")
string(FIND "${run_output}" "Library soname: [${SO_SONAME}]" soname_found)
if(soname_found EQUAL -1)
  message(FATAL_ERROR "libsuperoffload.so.${SO_VERSION} does not have the SONAME ${SO_SONAME}:\n${run_output}")
endif()

# A lean install: the binaries are stripped (debug info, if installed at all, is in .debug/
# directories, left out of the count). Limits: the shared library 8 MB, the whole tree 60 MB
# (about 5.0 MB and 35 MB stripped on x86-64 in 0.3.0; 43 MB and 255 MB unstripped).
file(SIZE "${libdir}/libsuperoffload.so.${SO_VERSION}" shared_size)
if(shared_size GREATER 8000000)
  message(FATAL_ERROR "libsuperoffload.so.${SO_VERSION} has ${shared_size} bytes (limit 8 MB): not stripped?")
endif()
file(GLOB_RECURSE installed LIST_DIRECTORIES false "${prefix}/*")
set(tree_size 0)
foreach(f IN LISTS installed)
  if(NOT f MATCHES "/\\.debug/" AND NOT IS_SYMLINK "${f}")
    file(SIZE "${f}" size)
    math(EXPR tree_size "${tree_size} + ${size}")
  endif()
endforeach()
if(tree_size GREATER 60000000)
  message(FATAL_ERROR "the install tree has ${tree_size} bytes (limit 60 MB)")
endif()
message(STATUS "install tree: ${tree_size} bytes, shared library ${shared_size} bytes")

# configure_build_run(<name> <prefix>): the consumer against <prefix>, then its programs.
function(configure_build_run name pfx)
  set(bin "${SO_WORK_DIR}/${name}")
  run("${CMAKE_COMMAND}" -S "${SO_CONSUMER_SOURCE_DIR}" -B "${bin}" -G "${SO_GENERATOR}"
      "-DCMAKE_C_COMPILER=${SO_C_COMPILER}" "-DCMAKE_PREFIX_PATH=${pfx}"
      "-DSO_WANT_VERSION=${major}.${minor}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
  string(FIND "${run_output}" "found SuperOffload ${SO_VERSION} in ${pfx}/" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "the consumer did not find SuperOffload ${SO_VERSION} in ${pfx}:\n${run_output}")
  endif()
  run("${CMAKE_COMMAND}" --build "${bin}")
  set(apps app app_static)
  if(EXISTS "${bin}/app_cxx")
    list(APPEND apps app_cxx)
  endif()
  foreach(app IN LISTS apps)
    run("${bin}/${app}")
    message(STATUS "${name}/${app}: ${run_output}")
  endforeach()
  # The shared one really loads the library from the prefix, by its SONAME.
  run(readelf -d "${bin}/app")
  string(FIND "${run_output}" "[${SO_SONAME}]" needed)
  if(needed EQUAL -1)
    message(FATAL_ERROR "app does not record NEEDED ${SO_SONAME}:\n${run_output}")
  endif()
endfunction()

configure_build_run(consumer "${prefix}")

# The package is relocatable: a copy of the prefix elsewhere works the same.
set(moved "${SO_WORK_DIR}/moved-prefix")
file(COPY "${prefix}/" DESTINATION "${moved}")
configure_build_run(consumer-moved "${moved}")

# SameMinorVersion: asking for major.(minor+1) must fail to configure.
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SO_CONSUMER_SOURCE_DIR}" -B "${SO_WORK_DIR}/consumer-too-new"
          -G "${SO_GENERATOR}" "-DCMAKE_C_COMPILER=${SO_C_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix}"
          "-DSO_WANT_VERSION=${major}.${next_minor}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "find_package(SuperOffload ${major}.${next_minor}) succeeded against ${SO_VERSION}")
endif()
string(FIND "${err}" "${major}.${next_minor}" mentions)
if(mentions EQUAL -1)
  message(FATAL_ERROR "the failure does not mention the version asked for:\n${err}")
endif()
message(STATUS "find_package(SuperOffload ${major}.${next_minor}) is refused, as it should be")

# pkg-config, where installed: flags, version, and a program built with them.
if(SO_PKG_CONFIG)
  set(env "${CMAKE_COMMAND}" -E env "PKG_CONFIG_PATH=${libdir}/pkgconfig")
  run(${env} "${SO_PKG_CONFIG}" --modversion superoffload)
  string(STRIP "${run_output}" pc_version)
  if(NOT pc_version STREQUAL SO_VERSION)
    message(FATAL_ERROR "pkg-config --modversion superoffload: ${pc_version}")
  endif()
  run(${env} "${SO_PKG_CONFIG}" --cflags --libs superoffload)
  string(STRIP "${run_output}" flags)
  message(STATUS "pkg-config --cflags --libs superoffload: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run("${SO_C_COMPILER}" "${SO_CONSUMER_SOURCE_DIR}/main.c" -o "${SO_WORK_DIR}/app_pkgconfig" ${flags}
      -lm "-Wl,-rpath,${libdir}")
  run("${SO_WORK_DIR}/app_pkgconfig")
  message(STATUS "app_pkgconfig: ${run_output}")
  run(${env} "${SO_PKG_CONFIG}" --static --libs superoffload)
  string(FIND "${run_output}" "-lpthread" has_pthread)
  if(has_pthread EQUAL -1)
    message(FATAL_ERROR "pkg-config --static --libs lacks the system libraries: ${run_output}")
  endif()
else()
  message(STATUS "pkg-config not found: its check is skipped")
endif()
