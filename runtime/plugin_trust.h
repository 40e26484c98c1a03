// Whether a plugin directory or file may be loaded: its code runs in the
// caller's process, so nobody but root and the user running the program may
// be able to change it.
#pragma once

#include <string>

namespace mha::rt {

// "" when the directory is trusted, else why not: it is not a directory, is
// not owned by root or the current user, or others can write to it (group
// write is accepted only for the owner's private group: a group of that name
// with no other members, as Debian/Ubuntu create per user) -- it, and every
// directory above it once symbolic links are resolved, where one that others
// may write to passes only with its sticky bit (/tmp) and a trusted owner.
// Paths in the reasons are escaped (printable).
std::string untrusted_directory(const std::string& directory);

// The same rules for a plugin file and the directories above the file it
// resolves to (a symbolic link may lead out of the plugin directory); ""
// when trusted.  A missing file is reported by the caller, not here.
std::string untrusted_file(const std::string& path);

}  // namespace mha::rt
