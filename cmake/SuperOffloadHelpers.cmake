# Helpers shared by the top-level CMakeLists.txt and c_tests/.

# What a C program linking the Rust staticlib must add: the output of
#   cargo rustc --release --lib --crate-type staticlib -- --print native-static-libs
# on x86_64-unknown-linux-gnu (rustc 1.95): -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc.
# libc is linked anyway, so it is left out.
set(SO_NATIVE_STATIC_LIBS gcc_s util rt pthread m dl)

# so_relative_prefix(<out> <dir>): the path from <dir> (relative to the install prefix) back
# to the prefix, written with ${pcfiledir} for pkg-config, e.g. lib/pkgconfig -> ${pcfiledir}/../..
function(so_relative_prefix out dir)
  string(REGEX REPLACE "/+$" "" dir "${dir}")
  string(REGEX REPLACE "[^/]+" ".." up "${dir}")
  set(${out} "\${pcfiledir}/${up}" PARENT_SCOPE)
endfunction()

# so_soname(<out> <major> <minor>): the shared library's SONAME for that version, as build.rs
# gives it: libsuperoffload.so.0.<minor> while the major version is 0 (each minor release
# changes the ABI), libsuperoffload.so.<major> from 1.0 on.
function(so_soname out major minor)
  if(major EQUAL 0)
    set(${out} "libsuperoffload.so.0.${minor}" PARENT_SCOPE)
  else()
    set(${out} "libsuperoffload.so.${major}" PARENT_SCOPE)
  endif()
endfunction()
