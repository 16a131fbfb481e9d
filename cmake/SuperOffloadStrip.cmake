# Run at install time (install(CODE) in the top-level CMakeLists.txt): strips the installed
# binaries and, with SO_INSTALL_DEBUG_INFO, keeps their debug info in separate files.
#
# Inputs: SO_STRIP_FILES (a list of <kind>:<path relative to the prefix>, kind being
# program, shared or static), SO_STRIP and SO_OBJCOPY (the binutils CMake found),
# SO_INSTALL_DEBUG_INFO (ON/OFF), and CMake's own CMAKE_INSTALL_PREFIX (which follows
# `cmake --install --prefix`) and $ENV{DESTDIR}.
#
# - program, shared: `strip --strip-unneeded` (the dynamic symbol table stays: the library's
#   exported so_* functions are untouched);
# - static: `strip --strip-debug` (every object keeps its symbol table, which linking needs),
#   and the LLVM bitcode that rustc embeds in the standard library's objects for LTO is
#   removed (.llvmbc, .llvmcmd): a C or C++ program linking the archive never reads it.
# With SO_INSTALL_DEBUG_INFO the debug info of a program or shared library is first copied
# into <dir>/.debug/<name>.debug and linked from the stripped file (.gnu_debuglink), where
# gdb looks for it.
if(NOT SO_STRIP OR NOT EXISTS "${SO_STRIP}")
  message(FATAL_ERROR "superoffload install: no strip program (CMAKE_STRIP is '${SO_STRIP}')")
endif()

function(so_strip_run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "superoffload install: failed (${rc}): ${cmd}\n${err}")
  endif()
endfunction()

foreach(entry IN LISTS SO_STRIP_FILES)
  string(REGEX MATCH "^([a-z]+):(.*)$" _ "${entry}")
  set(kind "${CMAKE_MATCH_1}")
  set(file "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/${CMAKE_MATCH_2}")
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "superoffload install: ${file} was not installed")
  endif()
  if(kind STREQUAL "static")
    message(STATUS "Stripping debug info: ${file}")
    so_strip_run("${SO_STRIP}" --strip-debug --remove-section=.llvmbc --remove-section=.llvmcmd "${file}")
    continue()
  endif()
  if(SO_INSTALL_DEBUG_INFO)
    if(NOT SO_OBJCOPY OR NOT EXISTS "${SO_OBJCOPY}")
      message(FATAL_ERROR "superoffload install: SO_INSTALL_DEBUG_INFO needs objcopy (CMAKE_OBJCOPY is '${SO_OBJCOPY}')")
    endif()
    get_filename_component(dir "${file}" DIRECTORY)
    get_filename_component(name "${file}" NAME)
    file(MAKE_DIRECTORY "${dir}/.debug")
    set(debug "${dir}/.debug/${name}.debug")
    message(STATUS "Splitting debug info: ${debug}")
    so_strip_run("${SO_OBJCOPY}" --only-keep-debug "${file}" "${debug}")
    so_strip_run("${SO_STRIP}" --strip-unneeded "${file}")
    # The link is relative to the file's directory: gdb looks in <dir>/.debug/.
    execute_process(COMMAND "${SO_OBJCOPY}" "--add-gnu-debuglink=${name}.debug" "${file}"
                    WORKING_DIRECTORY "${dir}/.debug" RESULT_VARIABLE rc ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "superoffload install: objcopy --add-gnu-debuglink failed on ${file}: ${err}")
    endif()
  else()
    message(STATUS "Stripping: ${file}")
    so_strip_run("${SO_STRIP}" --strip-unneeded "${file}")
  endif()
endforeach()
