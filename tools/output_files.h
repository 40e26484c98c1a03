// The output files of the tools, written so that a failure changes none of
// them: each is first written to a temporary file in its own directory, then
// renamed over its name.
#pragma once

#include <sys/types.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "npy.h"

namespace mha_tools {

// A command line that names one file as two outputs, or an input as an output.
class OutputConflict : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file as the command line names it: {"--out", "o.npy"}.
struct NamedFile {
  std::string flag, path;
};

class OutputFiles {
 public:
  // Checks the outputs, given in the order in which they land (the primary
  // output last), before anything is computed:
  //  - no two name the same file and none names an input (OutputConflict):
  //    files that exist are compared by device and inode (symbolic and hard
  //    links count), files that do not exist yet by the canonical path of
  //    their directory and their name;
  //  - each can be created: its directory exists and is writable, and it is
  //    not a directory (NpyError, "<flag> <path>: cannot create: ...").
  // A symbolic link as an output is followed: the file it points to is
  // replaced, the link stays.  Inputs that do not exist are skipped (reading
  // them fails later with its own message).
  OutputFiles(std::vector<NamedFile> outputs, const std::vector<NamedFile>& inputs);

  // Writes arrays[i] (same order as the outputs) as .npy:
  //  1. every output that is a regular file or does not exist yet is written
  //     to a temporary file ".<name>.XXXXXX" in its directory (flushed with
  //     fsync; the mode of the file it replaces, else 0666 & ~umask);
  //  2. outputs that exist and are not regular files (/dev/null, a pipe from
  //     the shell) are written in place;
  //  3. the temporary files are renamed over their names, in order: the
  //     secondary outputs first, the primary output last.
  // A failure at any step removes the temporary files and undoes the renames
  // already done (the old file is restored from a hard link taken just
  // before its rename, or the new file removed when there was none), so no
  // output file is changed; then NpyError is thrown.
  void commit(const std::vector<const NpyArray*>& arrays);

  // The rename that step 3 uses; tests replace it to make it fail.
  std::function<int(const char*, const char*)> rename_function;

 private:
  struct Target {
    NamedFile named;
    std::string target;  // the name that is replaced: symbolic links followed
    bool exists = false, in_place = false;
    mode_t mode = 0;
  };
  std::vector<Target> targets_;
};

}  // namespace mha_tools
