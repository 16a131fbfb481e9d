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
