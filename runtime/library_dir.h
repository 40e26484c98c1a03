// Where libmha.so itself lives: the one directory plugins are loaded from
// (unless MHA_PLUGIN_DIR names another).
#pragma once

#include <string>

namespace mha::rt {

// The absolute, symlink-free directory of libmha.so, resolved when the
// library was loaded -- before the program could change its working
// directory, so a library loaded by a relative path ("./lib/libmha.so",
// LD_LIBRARY_PATH=lib) never turns into "plugins from the current directory".
// Empty when it could not be resolved; then *why says why.
std::string library_directory(std::string* why);

}  // namespace mha::rt
