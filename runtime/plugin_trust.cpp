#include "plugin_trust.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "error.h"

namespace mha::rt {
namespace {

// True when gid is the private group of user uid: the group bears the user's
// name, is the user's primary group and lists no other member.
bool private_group_of(gid_t gid, uid_t uid) {
  passwd pw{};
  passwd* pw_result = nullptr;
  char pw_buffer[4096];
  if (getpwuid_r(uid, &pw, pw_buffer, sizeof pw_buffer, &pw_result) != 0 || pw_result == nullptr) {
    return false;
  }
  group gr{};
  group* gr_result = nullptr;
  char gr_buffer[16384];
  if (getgrgid_r(gid, &gr, gr_buffer, sizeof gr_buffer, &gr_result) != 0 || gr_result == nullptr) {
    return false;
  }
  if (pw.pw_gid != gid || std::strcmp(gr.gr_name, pw.pw_name) != 0) return false;
  for (char** member = gr.gr_mem; member != nullptr && *member != nullptr; ++member) {
    if (std::strcmp(*member, pw.pw_name) != 0) return false;
  }
  return true;
}

// Why others could change a file or directory with this status ("is owned by
// uid ...", "is writable by every user (mode 0777)", ...), or "".
std::string problem(const struct stat& st) {
  const uid_t me = geteuid();
  char mode[16];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  if (st.st_uid != 0 && st.st_uid != me) {
    return "is owned by uid " + std::to_string(st.st_uid) + ", neither root nor this user (uid " +
           std::to_string(me) + ")";
  }
  if (st.st_mode & S_IWOTH) return std::string("is writable by every user (mode ") + mode + ")";
  if ((st.st_mode & S_IWGRP) && !private_group_of(st.st_gid, st.st_uid)) {
    return "is writable by its group (gid " + std::to_string(st.st_gid) + ", mode " + mode + ")";
  }
  return {};
}

std::string shown(const std::string& path) {
  return printable(path.c_str(), 256);
}

// The directories above `real` (a canonical path), up to "/": whoever may
// rename an entry of one of them can put other code in the plugins' place.
// One that others may write to passes with its sticky bit (/tmp): then only
// an entry's owner, or the directory's, renames it.
std::string untrusted_ancestor(const std::string& real) {
  std::string dir = real;
  while (dir.size() > 1) {
    const size_t slash = dir.find_last_of('/');
    dir = slash == 0 || slash == std::string::npos ? "/" : dir.substr(0, slash);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return "the directory " + shown(dir) + ", which cannot be read: " + std::strerror(errno);
    }
    const std::string why = problem(st);
    const bool trusted_owner = st.st_uid == 0 || st.st_uid == geteuid();
    const bool sticky = (st.st_mode & S_ISVTX) != 0;
    if (!why.empty() && !(sticky && trusted_owner)) {
      return "the directory " + shown(dir) + ", which " + why;
    }
  }
  return {};
}

// The canonical path (symbolic links resolved), or "" with errno set.
std::string canonical(const std::string& path) {
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) return {};
  std::string result(real);
  std::free(real);
  return result;
}

// Why `path` (called `name` in the reason), whose status is st, may not be
// trusted: its own owner and mode, then every directory above what it
// resolves to (for a plugin file, a symbolic link may lead out of the plugin
// directory).  "" when trusted.
std::string untrusted_path(const std::string& path, const struct stat& st,
                           const std::string& name) {
  if (const std::string why = problem(st); !why.empty()) return name + " " + why;
  const std::string real = canonical(path);
  if (real.empty()) return name + " cannot be resolved: " + std::strerror(errno);
  const std::string above = untrusted_ancestor(real);
  return above.empty() ? above : name + " lies under " + above;
}

}  // namespace

std::string untrusted_directory(const std::string& directory) {
  const std::string name = "the plugin directory " + shown(directory);
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) return name + " cannot be read: " + std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return name + " is not a directory";
  std::string why = untrusted_path(directory, st, name);
  if (!why.empty()) why += "; plugins are only loaded from a directory only its owner can change";
  return why;
}

std::string untrusted_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  const std::string name = "the plugin " + shown(path);
  if (!S_ISREG(st.st_mode)) return name + " is not a regular file";
  std::string why = untrusted_path(path, st, name);
  if (!why.empty()) why += "; it is not loaded";
  return why;
}

}  // namespace mha::rt
