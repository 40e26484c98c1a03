#include "plugin_trust.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

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

std::string check(const std::string& path, const struct stat& st, const char* what) {
  const uid_t me = geteuid();
  char mode[16];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  if (st.st_uid != 0 && st.st_uid != me) {
    return std::string(what) + " " + path + " is owned by uid " + std::to_string(st.st_uid) +
           ", neither root nor this user (uid " + std::to_string(me) + ")";
  }
  if (st.st_mode & S_IWOTH) {
    return std::string(what) + " " + path + " is writable by every user (mode " + mode + ")";
  }
  if ((st.st_mode & S_IWGRP) && !private_group_of(st.st_gid, st.st_uid)) {
    return std::string(what) + " " + path + " is writable by its group (gid " +
           std::to_string(st.st_gid) + ", mode " + mode + ")";
  }
  return {};
}

}  // namespace

std::string untrusted_directory(const std::string& directory) {
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) {
    return "the plugin directory " + directory + " cannot be read: " + std::strerror(errno);
  }
  if (!S_ISDIR(st.st_mode)) return "the plugin directory " + directory + " is not a directory";
  std::string why = check(directory, st, "the plugin directory");
  if (!why.empty()) why += "; plugins are only loaded from a directory only its owner can change";
  return why;
}

std::string untrusted_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  if (!S_ISREG(st.st_mode)) return "the plugin " + path + " is not a regular file";
  std::string why = check(path, st, "the plugin");
  if (!why.empty()) why += "; it is not loaded";
  return why;
}

}  // namespace mha::rt
