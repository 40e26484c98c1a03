#include "output_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "tool_util.h"

namespace mha_tools {
namespace {

namespace fs = std::filesystem;

std::string error_text(int err) {
  return std::strerror(err);
}

std::string named(const NamedFile& f) {
  return f.flag + " " + escape(f.path);
}

// The path with symbolic links in its last component followed (the file a
// write through the path would change); directories in between are left as
// they are.
std::string follow_links(const NamedFile& f) {
  std::string path = f.path;
  for (int hop = 0; hop < 40; ++hop) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    std::string link(PATH_MAX, '\0');
    const ssize_t n = ::readlink(path.c_str(), link.data(), link.size());
    if (n < 0) throw NpyError(named(f) + ": cannot read the link: " + error_text(errno));
    link.resize(static_cast<std::size_t>(n));
    const fs::path parent = fs::path(path).parent_path();
    path = (fs::path(link).is_absolute() || parent.empty()) ? link : (parent / link).string();
  }
  throw NpyError(named(f) + ": cannot create: " + error_text(ELOOP));
}

std::string directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// The canonical path of the directory, then the name.
std::string canonical_name(const NamedFile& f, const std::string& target) {
  char* dir = ::realpath(directory_of(target).c_str(), nullptr);
  if (dir == nullptr) throw NpyError(named(f) + ": cannot create: " + error_text(errno));
  std::string out = dir;
  std::free(dir);
  return out + "/" + fs::path(target).filename().string();
}

struct Identity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string name;  // canonical directory + name (outputs only)
};

bool same_file(const Identity& a, const Identity& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  return !a.name.empty() && a.name == b.name;
}

const char* const unchanged_text = "; no output file was changed";

mode_t default_mode() {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return 0666 & ~mask;
}

void write_or_throw(int fd, const NpyArray& array, const std::string& what, const char* suffix) {
  try {
    write_npy_fd(fd, array);
  } catch (const NpyError& e) {
    throw NpyError(what + ": " + e.what() + suffix);
  }
}

}  // namespace

OutputFiles::OutputFiles(std::vector<NamedFile> outputs, const std::vector<NamedFile>& inputs)
    : rename_function([](const char* from, const char* to) { return ::rename(from, to); }) {
  std::vector<Identity> ids;
  for (NamedFile& f : outputs) {
    Target t;
    Identity id;
    struct stat st {};
    if (::stat(f.path.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) throw NpyError(named(f) + ": cannot create: it is a directory");
      t.exists = true;
      t.in_place = !S_ISREG(st.st_mode);
      t.mode = st.st_mode & 07777;
      id.exists = true;
      id.dev = st.st_dev;
      id.ino = st.st_ino;
    }
    if (t.in_place) {
      // A device or a pipe: opened by its name (/dev/stdout goes through
      // /proc/self/fd, whose links are not paths).
      t.target = f.path;
    } else if (t.exists) {
      char* real = ::realpath(f.path.c_str(), nullptr);
      if (real == nullptr) throw NpyError(named(f) + ": cannot create: " + error_text(errno));
      t.target = real;
      std::free(real);
      id.name = t.target;
    } else {
      t.target = follow_links(f);  // a dangling link: the file it will create
      id.name = canonical_name(f, t.target);
    }
    if (!t.in_place && ::access(directory_of(t.target).c_str(), W_OK | X_OK) != 0) {
      throw NpyError(named(f) + ": cannot create: " + error_text(errno));
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (same_file(ids[i], id)) {
        throw OutputConflict(named(f) + " is the same file as " + named(targets_[i].named) +
                             ": give each output its own file");
      }
    }
    t.named = std::move(f);
    targets_.push_back(std::move(t));
    ids.push_back(std::move(id));
  }
  for (const NamedFile& in : inputs) {
    struct stat st {};
    if (in.path.empty() || ::stat(in.path.c_str(), &st) != 0) continue;
    Identity id;
    id.exists = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (same_file(ids[i], id)) {
        throw OutputConflict(named(targets_[i].named) + " is the input " + named(in) +
                             " (the same file): an output must not replace an input");
      }
    }
  }
}

void OutputFiles::commit(const std::vector<const NpyArray*>& arrays) {
  if (arrays.size() != targets_.size()) throw NpyError("internal: outputs and arrays differ");
  std::vector<std::string> temps(targets_.size());
  const auto remove_temps = [&temps] {
    for (const std::string& t : temps) {
      if (!t.empty()) ::unlink(t.c_str());
    }
  };
  const mode_t new_mode = default_mode();
  try {
    // 1. Temporary files.
    for (std::size_t i = 0; i < targets_.size(); ++i) {
      const Target& t = targets_[i];
      if (t.in_place) continue;
      const std::string what = named(t.named);
      std::string name =
          directory_of(t.target) + "/." + fs::path(t.target).filename().string() + ".XXXXXX";
      const int fd = ::mkostemp(name.data(), O_CLOEXEC);
      if (fd < 0) throw NpyError(what + ": cannot create: " + error_text(errno) + unchanged_text);
      temps[i] = name;
      struct Closer {
        int fd;
        ~Closer() {
          if (fd >= 0) ::close(fd);
        }
      } closer{fd};
      write_or_throw(fd, *arrays[i], what, unchanged_text);
      if (::fchmod(fd, t.exists ? t.mode : new_mode) != 0 || ::fsync(fd) != 0 ||
          ::close(std::exchange(closer.fd, -1)) != 0) {
        throw NpyError(what + ": write error: " + error_text(errno) + unchanged_text);
      }
    }
  } catch (...) {
    remove_temps();
    throw;
  }
  // 2. The renames, undone when one fails.
  struct Done {
    std::string target, backup;
  };
  std::vector<Done> done;
  const auto undo = [&done] {
    bool restored = true;
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      const int rc = it->backup.empty() ? ::unlink(it->target.c_str())
                                        : ::rename(it->backup.c_str(), it->target.c_str());
      restored = restored && rc == 0;
    }
    return restored ? std::string(unchanged_text)
                    : std::string("; the outputs renamed before it could not all be restored");
  };
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    const Target& t = targets_[i];
    if (t.in_place) continue;
    std::string backup;
    struct stat st {};
    if (::lstat(t.target.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      backup = temps[i] + ".old";
      if (::link(t.target.c_str(), backup.c_str()) != 0) backup.clear();
    }
    if (rename_function(temps[i].c_str(), t.target.c_str()) != 0) {
      const int err = errno;
      if (!backup.empty()) ::unlink(backup.c_str());
      remove_temps();
      throw NpyError(named(t.named) + ": cannot replace the file: " + error_text(err) + undo());
    }
    temps[i].clear();
    done.push_back({t.target, backup});
  }
  // 3. Devices and pipes (which cannot be undone), in place.
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    const Target& t = targets_[i];
    if (!t.in_place) continue;
    const std::string what = named(t.named);
    const int fd = ::open(t.target.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    if (fd < 0) throw NpyError(what + ": cannot open: " + error_text(errno) + undo());
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    try {
      write_npy_fd(fd, *arrays[i]);
    } catch (const NpyError& e) {
      throw NpyError(what + ": " + e.what() + undo());
    }
  }
  for (const Done& d : done) {
    if (!d.backup.empty()) ::unlink(d.backup.c_str());
  }
}

}  // namespace mha_tools
