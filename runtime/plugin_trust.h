// Whether a plugin directory or file may be loaded: its code runs in the
// caller's process, so nobody but root and the user running the program may
// be able to change it.
#pragma once

#include <string>

namespace mha::rt {

// "" when the directory is trusted, else why not: it is not a directory, is
// not owned by root or the current user, or others can write to it (group
// write is accepted only for the owner's private group: a group of that name
// with no other members, as Debian/Ubuntu create per user).
std::string untrusted_directory(const std::string& directory);

// The same rules for a plugin file (after following symbolic links); "" when
// trusted.  A missing file is reported by the caller, not here.
std::string untrusted_file(const std::string& path);

}  // namespace mha::rt
