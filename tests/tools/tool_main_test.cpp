// The programs in process (tool_main.h): exact exit statuses, stdout that
// cannot be written, outputs that are replaced only when all are written;
// the text escaping and the output-file checks on their own.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdio_ext.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "attention_run.h"
#include "npy.h"
#include "output_files.h"
#include "tool_main.h"
#include "tool_util.h"

namespace {

namespace fs = std::filesystem;
using mha_tools::NpyArray;
using mha_tools::NpyDtype;

NpyArray filled(NpyDtype dtype, std::vector<int64_t> shape, double step) {
  NpyArray a(dtype, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i) a.set_from_double(i, std::fmod(step * double(i), 3.0));
  return a;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The entries of a directory, dot files too.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The bits of a float: outputs are compared bit for bit.
uint32_t bits(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

struct Result {
  int status;
  std::string out, err;
};

// Runs a program with its arguments (argv[0] is added) and captures stdout and stderr.
template <typename Main>
Result run(Main program, const char* name, std::initializer_list<std::string> args) {
  std::vector<std::string> storage = {name};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<const char*> argv;
  argv.reserve(storage.size());
  for (const auto& s : storage) argv.push_back(s.c_str());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int status = program(static_cast<int>(argv.size()), argv.data());
  std::fflush(stdout);
  Result r{status, ::testing::internal::GetCapturedStdout(),
           ::testing::internal::GetCapturedStderr()};
  return r;
}

Result mha_run(std::initializer_list<std::string> args) {
  return run(mha_tools::mha_run_main, "mha-run", args);
}

class ToolMain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "mha_tool_main_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    mha_tools::write_npy(path("q"), filled(NpyDtype::F32, {1, 2, 3, 4}, 0.1));
    mha_tools::write_npy(path("k"), filled(NpyDtype::F32, {1, 1, 5, 4}, 0.2));
    // V large enough that the output (1, 2, 3, 300) is far bigger than the LSE.
    mha_tools::write_npy(path("v"), filled(NpyDtype::F32, {1, 1, 5, 300}, 0.3));
    mha_tools::write_npy(path("q64"), filled(NpyDtype::F64, {1, 2, 3, 4}, 0.1));
    NpyArray huge = filled(NpyDtype::F64, {1, 2, 3, 4}, 0.1);
    huge.set_from_double(5, 1e300);  // finite in float64, not in float32
    mha_tools::write_npy(path("q_huge"), huge);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name + ".npy"; }

  std::string dir_;
};

TEST_F(ToolMain, ExitStatus) {
  const std::string q = path("q"), k = path("k"), v = path("v"), out = path("out");
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out}).status, 0);
  // 1: the run failed.
  EXPECT_EQ(mha_run({"--q", path("none"), "--k", k, "--v", v, "--out", out}).status, 1);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--scale", "0"}).status, 1);
  EXPECT_EQ(mha_run({"--q", path("q_huge"), "--k", k, "--v", v, "--out", out}).status, 1);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", dir_ + "/no/o.npy"}).status, 1);
  // 2: the command line is wrong.
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--out", out}).status, 2);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--lse", out}).status, 2);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", q}).status, 2);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--scale", "1e-50"}).status, 2);
  EXPECT_EQ(mha_run({"module", "--query", q, "--out", out}).status, 2);
  EXPECT_EQ(mha_run({"module", "--weights", dir_, "--query", q, "--out", out, "--average-weights"})
                .status,
            2);
  // CLI11's codes.
  EXPECT_EQ(mha_run({"--nonsense"}).status, 109);
  EXPECT_EQ(mha_run({"--q", q, "--threads", ""}).status, 105);
  EXPECT_EQ(mha_run({"--q", q, "--scale", ""}).status, 105);
  EXPECT_EQ(mha_run({"--q", q, "--causal", "diagonal"}).status, 105);
  EXPECT_EQ(mha_run({"--q", q, "--threads", "x"}).status, 104);
  // The dtype flags: values CLI11 refuses (105), attention-only flags given
  // to the module (2 before `module`, CLI11's 109 after it).
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--dtype", "i8"}).status, 105);
  EXPECT_EQ(mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--kv-dtype", "bogus"}).status,
            105);
  EXPECT_EQ(
      mha_run({"--q", q, "--k", k, "--v", v, "--out", out, "--dtype", "f16", "--kv-dtype", "i8"})
          .status,
      0);
  EXPECT_EQ(
      mha_run({"--dtype", "bf16", "module", "--weights", dir_, "--query", q, "--out", out}).status,
      2);
  EXPECT_EQ(
      mha_run({"module", "--weights", dir_, "--query", q, "--out", out, "--dtype", "bf16"}).status,
      109);
  EXPECT_EQ(mha_run({"module", "--sequence-first", "--batch-first"}).status, 108);
  // --help and --version: 0, on stdout.
  const Result help = mha_run({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("Exit status:"), std::string::npos);
  const Result version = mha_run({"--version"});
  EXPECT_EQ(version.status, 0);
  EXPECT_EQ(version.out, std::string("mha-run ") + mha_version() + "\n");
  EXPECT_EQ(mha_run({"module", "--version"}).out, version.out);
  const Result info_version = run(mha_tools::mha_info_main, "mha-info", {"--version"});
  EXPECT_EQ(info_version.status, 0);
  EXPECT_EQ(info_version.out, std::string("mha-info ") + mha_version() + "\n");
  EXPECT_EQ(run(mha_tools::mha_info_main, "mha-info", {"--bogus"}).status, 109);
}

TEST_F(ToolMain, EmptyValuesAreRefused) {
  for (const char* flag : {"--threads", "--scale", "--repeat", "--backend", "--out", "--lse"}) {
    const Result r = mha_run(
        {"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", path("o"), flag, ""});
    EXPECT_EQ(r.status, 105) << flag;
    EXPECT_NE(r.err.find(std::string(flag) + ": the value is empty"), std::string::npos) << r.err;
  }
}

TEST_F(ToolMain, TinyScaleSaysWhatWasTyped) {
  const Result r = mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out",
                            path("o"), "--scale", "1e-50"});
  EXPECT_EQ(r.err,
            "mha-run: --scale 1e-50: the value was typed as 1e-50 and rounds to 0 in float32, the "
            "precision mha computes in (the smallest positive float32 is 1.4e-45)\n");
  // Subnormal, but not zero: accepted.
  EXPECT_EQ(mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", path("o"),
                     "--scale", "1e-40"})
                .status,
            0);
}

TEST_F(ToolMain, RepeatDetectsAFailedStdout) {
  const int saved = ::dup(1);
  ASSERT_GE(saved, 0);
  const int full = ::open("/dev/full", O_WRONLY);
  if (full < 0) {
    ::close(saved);
    GTEST_SKIP() << "no /dev/full";
  }
  std::fflush(stdout);
  ::dup2(full, 1);
  ::close(full);
  ::testing::internal::CaptureStderr();
  const char* argv[] = {"mha-run", "--q",      nullptr, "--k",       nullptr, "--v",
                        nullptr,   "--repeat", "2",     "--threads", "1"};
  const std::string q = path("q"), k = path("k"), v = path("v");
  argv[2] = q.c_str();
  argv[4] = k.c_str();
  argv[6] = v.c_str();
  const int status = mha_tools::mha_run_main(11, argv);
  __fpurge(stdout);  // what could not be written
  std::clearerr(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(status, 1);
  EXPECT_EQ(err, "mha-run: cannot write to stdout: No space left on device\n");
}

// ---------------------------------------------------------------- atomic outputs

TEST_F(ToolMain, FailedWriteLeavesTheOldFilesAndNoTemporaryFile) {
  const std::string out = path("out"), lse = path("lse");
  std::ofstream(out) << "old output";
  std::ofstream(lse) << "old lse";
  const std::vector<std::string> before = entries(dir_);
  // The LSE (< 1 KiB) fits under the limit, the output (7 KiB) does not.
  struct sigaction ignore {
  }, old_action{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old_action), 0);
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  const Result r =
      mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", out, "--lse", lse});
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(
      r.err.find("--out " + out + ": write error: File too large; no output file was changed"),
      std::string::npos)
      << r.err;
  EXPECT_EQ(file_bytes(out), "old output");
  EXPECT_EQ(file_bytes(lse), "old lse");
  EXPECT_EQ(entries(dir_), before);
}

TEST_F(ToolMain, OutputsLandTogether) {
  const std::string out = path("out"), lse = path("lse");
  std::ofstream(out) << "old output";
  ::chmod(out.c_str(), 0640);
  ASSERT_EQ(
      mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", out, "--lse", lse})
          .status,
      0);
  EXPECT_EQ(mha_tools::read_npy(out).shape(), (std::vector<int64_t>{1, 2, 3, 300}));
  EXPECT_EQ(mha_tools::read_npy(lse).shape(), (std::vector<int64_t>{1, 2, 3}));
  struct stat st {};
  ASSERT_EQ(::stat(out.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);  // the mode of the file it replaced
  // No temporary or backup file is left.
  for (const std::string& name : entries(dir_)) EXPECT_NE(name[0], '.') << name;
}

TEST_F(ToolMain, OutputThroughASymlinkReplacesItsTarget) {
  const std::string target = path("target"), link = path("link");
  std::ofstream(target) << "old";
  fs::create_symlink(target, link);
  ASSERT_EQ(mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", link}).status,
            0);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(mha_tools::read_npy(target).shape(), (std::vector<int64_t>{1, 2, 3, 300}));
}

TEST_F(ToolMain, FloatSixtyFourAndRankThreeInputs) {
  const std::string out32 = path("out32"), out64 = path("out64");
  ASSERT_EQ(mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--out", out32}).status,
            0);
  ::setenv("MHA_VERBOSE", "0", 1);
  const Result r =
      mha_run({"--q", path("q64"), "--k", path("k"), "--v", path("v"), "--out", out64});
  ::unsetenv("MHA_VERBOSE");
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(file_bytes(out32), file_bytes(out64));
  const Result huge =
      mha_run({"--q", path("q_huge"), "--k", path("k"), "--v", path("v"), "--out", out64});
  EXPECT_NE(huge.err.find("does not fit in float32"), std::string::npos) << huge.err;
}

// One rename of three fails: the ones before it are undone.
TEST_F(ToolMain, FailedRenameIsUndone) {
  const std::string a = path("a"), b = path("b"), c = path("c");
  std::ofstream(a) << "old a";  // b does not exist yet
  std::ofstream(c) << "old c";
  const std::vector<std::string> before = entries(dir_);
  mha_tools::OutputFiles files({{"--a", a}, {"--b", b}, {"--c", c}}, {});
  int calls = 0;
  files.rename_function = [&calls](const char* from, const char* to) {
    if (++calls == 3) {
      errno = EXDEV;
      return -1;
    }
    return ::rename(from, to);
  };
  const NpyArray x = filled(NpyDtype::F32, {4}, 1);
  try {
    files.commit({&x, &x, &x});
    ADD_FAILURE() << "the failed rename was not reported";
  } catch (const mha_tools::NpyError& e) {
    EXPECT_NE(std::string(e.what()).find("--c " + c + ": cannot replace the file: "),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("no output file was changed"), std::string::npos);
  }
  EXPECT_EQ(file_bytes(a), "old a");
  EXPECT_FALSE(fs::exists(b));
  EXPECT_EQ(file_bytes(c), "old c");
  EXPECT_EQ(entries(dir_), before);
}

TEST_F(ToolMain, OutputConflicts) {
  const std::string q = path("q");
  fs::create_hard_link(q, path("q_hard"));
  fs::create_symlink(q, path("q_sym"));
  const auto conflict = [&](std::vector<mha_tools::NamedFile> outputs) {
    try {
      mha_tools::OutputFiles files(std::move(outputs), {{"--q", q}});
      return std::string();
    } catch (const mha_tools::OutputConflict& e) {
      return std::string(e.what());
    }
  };
  EXPECT_NE(conflict({{"--out", q}}).find("is the input --q"), std::string::npos);
  EXPECT_NE(conflict({{"--out", path("q_hard")}}).find("is the input --q"), std::string::npos);
  EXPECT_NE(conflict({{"--out", path("q_sym")}}).find("is the input --q"), std::string::npos);
  // Files that do not exist yet: the same directory and name, however spelled.
  fs::create_directories(dir_ + "/sub");
  fs::create_directory_symlink(dir_ + "/sub", dir_ + "/sub_link");
  EXPECT_NE(conflict({{"--lse", dir_ + "/sub/x.npy"}, {"--out", dir_ + "/sub_link/x.npy"}})
                .find("--out " + dir_ + "/sub_link/x.npy is the same file as --lse "),
            std::string::npos);
  EXPECT_NE(conflict({{"--lse", dir_ + "/sub/x.npy"}, {"--out", dir_ + "/sub/../sub/./x.npy"}})
                .find("is the same file as"),
            std::string::npos);
  // A dangling symbolic link is followed too.
  fs::create_symlink(dir_ + "/sub/y.npy", dir_ + "/dangling.npy");
  EXPECT_NE(conflict({{"--lse", dir_ + "/dangling.npy"}, {"--out", dir_ + "/sub/y.npy"}})
                .find("is the same file as"),
            std::string::npos);
  EXPECT_EQ(conflict({{"--lse", dir_ + "/sub/x.npy"}, {"--out", dir_ + "/sub/y.npy"}}), "");
}

// ---------------------------------------------------------------- packed batches

// --cu-seqlens-q/-k: each sequence's rows of --out and --lse are the bits
// mha-run gives for that sequence alone (its rows as a rank-3 [H, L, D]
// batch of one), with the causal rule, the window and ALiBi of its own
// lengths; a sequence without keys gives zeros and LSE -inf.  Usage errors
// exit 2, what the library refuses 1.
TEST_F(ToolMain, PackedBatchIsEachSequenceAlone) {
  const std::vector<int64_t> lens_q = {3, 0, 6, 2, 4}, lens_k = {5, 4, 6, 9, 0};
  const int64_t heads = 4, kv_heads = 2, d = 8, dv = 6, batch = 5;
  int64_t total_q = 0, total_k = 0;
  NpyArray cu_q(NpyDtype::I32, {batch + 1}), cu_k(NpyDtype::I32, {batch + 1});
  for (int64_t b = 0; b < batch; ++b) {
    total_q += lens_q[static_cast<size_t>(b)];
    total_k += lens_k[static_cast<size_t>(b)];
    cu_q.set_from_double(b + 1, static_cast<double>(total_q));
    cu_k.set_from_double(b + 1, static_cast<double>(total_k));
  }
  const NpyArray q = filled(NpyDtype::F32, {total_q, heads, d}, 0.37);
  const NpyArray k = filled(NpyDtype::F32, {total_k, kv_heads, d}, 0.23);
  const NpyArray v = filled(NpyDtype::F32, {total_k, kv_heads, dv}, 0.41);
  NpyArray slopes(NpyDtype::F32, {batch, heads});
  for (int64_t i = 0; i < slopes.size(); ++i) slopes.set_from_double(i, 0.05 * double(i % 7));
  for (const auto& [name, array] : {std::pair<const char*, const NpyArray*>{"q", &q},
                                    {"k", &k},
                                    {"v", &v},
                                    {"cu_q", &cu_q},
                                    {"cu_k", &cu_k},
                                    {"slopes", &slopes}}) {
    mha_tools::write_npy(path(name), *array);
  }
  const std::vector<std::string> flags = {"--causal", "bottom-right", "--window",
                                          "3,1",      "--softcap",    "2.5"};
  const auto with_flags = [&flags](std::vector<std::string> args) {
    args.insert(args.end(), flags.begin(), flags.end());
    return args;
  };
  const auto run_args = [](const std::vector<std::string>& args) {
    std::vector<const char*> argv = {"mha-run"};
    for (const std::string& a : args) argv.push_back(a.c_str());
    ::testing::internal::CaptureStderr();
    const int status = mha_tools::mha_run_main(static_cast<int>(argv.size()), argv.data());
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(err, "");
    return status;
  };
  ASSERT_EQ(
      run_args(with_flags({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--cu-seqlens-q",
                           path("cu_q"), "--cu-seqlens-k", path("cu_k"), "--alibi", path("slopes"),
                           "--out", path("out"), "--lse", path("lse")})),
      0);
  const NpyArray out = mha_tools::read_npy(path("out")), lse = mha_tools::read_npy(path("lse"));
  ASSERT_EQ(out.shape(), (std::vector<int64_t>{total_q, heads, dv}));
  ASSERT_EQ(lse.shape(), (std::vector<int64_t>{heads, total_q}));

  int64_t q0 = 0, k0 = 0, compared = 0;
  for (int64_t b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const int64_t lq = lens_q[static_cast<size_t>(b)], lk = lens_k[static_cast<size_t>(b)];
    if (lq > 0 && lk == 0) {
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t x = 0; x < dv; ++x)
            EXPECT_EQ(out.data_as<float>()[(i * heads + h) * dv + x], 0.0f);
          EXPECT_EQ(lse.data_as<float>()[h * total_q + i], -INFINITY);
        }
      }
    } else if (lq > 0) {
      // The sequence alone: [H, L, D] files of its rows, its row of slopes.
      const auto alone = [](const NpyArray& packed, int64_t first, int64_t len) {
        const int64_t h = packed.shape()[1], e = packed.shape()[2];
        NpyArray a(NpyDtype::F32, {h, len, e});
        for (int64_t r = 0; r < len; ++r)
          for (int64_t hh = 0; hh < h; ++hh)
            for (int64_t x = 0; x < e; ++x) {
              a.data_as<float>()[(hh * len + r) * e + x] =
                  packed.data_as<float>()[((first + r) * h + hh) * e + x];
            }
        return a;
      };
      mha_tools::write_npy(path("q1"), alone(q, q0, lq));
      mha_tools::write_npy(path("k1"), alone(k, k0, lk));
      mha_tools::write_npy(path("v1"), alone(v, k0, lk));
      NpyArray row(NpyDtype::F32, {heads});
      for (int64_t h = 0; h < heads; ++h) {
        row.data_as<float>()[h] = slopes.data_as<float>()[b * heads + h];
      }
      mha_tools::write_npy(path("slopes1"), row);
      ASSERT_EQ(
          run_args(with_flags({"--q", path("q1"), "--k", path("k1"), "--v", path("v1"), "--alibi",
                               path("slopes1"), "--out", path("out1"), "--lse", path("lse1")})),
          0);
      const NpyArray out1 = mha_tools::read_npy(path("out1")),
                     lse1 = mha_tools::read_npy(path("lse1"));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < lq; ++i) {
          for (int64_t x = 0; x < dv; ++x) {
            const float a = out1.data_as<float>()[(h * lq + i) * dv + x];
            const float c = out.data_as<float>()[((q0 + i) * heads + h) * dv + x];
            EXPECT_EQ(bits(a), bits(c)) << "out h " << h << " i " << i;
          }
          const float a = lse1.data_as<float>()[h * lq + i];
          const float c = lse.data_as<float>()[h * total_q + q0 + i];
          EXPECT_EQ(bits(a), bits(c)) << "lse h " << h << " i " << i;
          ++compared;
        }
      }
    }
    q0 += lq;
    k0 += lk;
  }
  EXPECT_EQ(compared, heads * (3 + 6 + 2));

  // Exit statuses: 2 for the command line, 1 for what the library refuses.
  const std::string q_path = path("q"), k_path = path("k"), v_path = path("v"), o = path("o");
  EXPECT_EQ(mha_run({"--q", q_path, "--k", k_path, "--v", v_path, "--out", o, "--cu-seqlens-q",
                     path("cu_q")})
                .status,
            2);
  EXPECT_EQ(mha_run({"--q", q_path, "--k", k_path, "--v", v_path, "--out", o, "--cu-seqlens-q",
                     path("cu_q"), "--cu-seqlens-k", path("cu_k"), "--valid-lens", path("cu_q")})
                .status,
            2);
  const Result swapped = mha_run({"--q", q_path, "--k", k_path, "--v", v_path, "--out", o,
                                  "--cu-seqlens-q", path("cu_k"), "--cu-seqlens-k", path("cu_q")});
  EXPECT_EQ(swapped.status, 1);
  EXPECT_NE(swapped.err.find("mha_attention_varlen failed (MHA_ERR_SHAPE_MISMATCH)"),
            std::string::npos)
      << swapped.err;
  EXPECT_EQ(mha_run({"--q", q_path, "--k", k_path, "--v", v_path, "--out", o, "--cu-seqlens-q", ""})
                .status,
            105);
}

// --block-table --seqused-k (--block-size): a paged cache gives the bits of
// the same keys packed (--cu-seqlens-k), whether the cache file is rank 4
// [num_blocks, block_size, Hkv, D] or rank 3 cut by --block-size; the flags
// without their companions are usage errors (2), a block id past the cache
// is the library's refusal (1).
TEST_F(ToolMain, PagedCacheIsThePackedBatch) {
  const std::vector<int64_t> lens_q = {1, 3, 1, 2}, lens_k = {20, 9, 0, 33};
  const int64_t heads = 4, kv_heads = 2, d = 8, batch = 4, block = 8, max_blocks = 5;
  int64_t total_q = 0, total_k = 0;
  NpyArray cu_q(NpyDtype::I32, {batch + 1}), cu_k(NpyDtype::I32, {batch + 1});
  NpyArray used(NpyDtype::I32, {batch}), table(NpyDtype::I32, {batch, max_blocks});
  for (int64_t b = 0; b < batch; ++b) {
    total_q += lens_q[static_cast<size_t>(b)];
    total_k += lens_k[static_cast<size_t>(b)];
    cu_q.set_from_double(b + 1, static_cast<double>(total_q));
    cu_k.set_from_double(b + 1, static_cast<double>(total_k));
    used.set_from_double(b, static_cast<double>(lens_k[static_cast<size_t>(b)]));
  }
  const NpyArray q = filled(NpyDtype::F32, {total_q, heads, d}, 0.37);
  const NpyArray k = filled(NpyDtype::F32, {total_k, kv_heads, d}, 0.23);
  const NpyArray v = filled(NpyDtype::F32, {total_k, kv_heads, d}, 0.41);
  // Blocks handed out from the end of the cache backwards; unused entries -1.
  const int64_t num_blocks = 12;
  NpyArray k_cache(NpyDtype::F32, {num_blocks, block, kv_heads, d});
  NpyArray v_cache(NpyDtype::F32, {num_blocks, block, kv_heads, d});
  int64_t next = num_blocks - 1, k0 = 0;
  const int64_t row = kv_heads * d;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < max_blocks; ++n) table.set_from_double(b * max_blocks + n, -1.0);
    for (int64_t j = 0; j < lens_k[static_cast<size_t>(b)]; ++j) {
      if (j % block == 0) table.set_from_double(b * max_blocks + j / block, double(next--));
      const int64_t blk =
          static_cast<int64_t>(table.data_as<int32_t>()[b * max_blocks + j / block]);
      for (int64_t x = 0; x < row; ++x) {
        k_cache.data_as<float>()[(blk * block + j % block) * row + x] =
            k.data_as<float>()[(k0 + j) * row + x];
        v_cache.data_as<float>()[(blk * block + j % block) * row + x] =
            v.data_as<float>()[(k0 + j) * row + x];
      }
    }
    k0 += lens_k[static_cast<size_t>(b)];
  }
  NpyArray k_flat(NpyDtype::F32, {num_blocks * block, kv_heads, d});
  NpyArray v_flat(NpyDtype::F32, {num_blocks * block, kv_heads, d});
  std::copy(k_cache.data_as<float>(), k_cache.data_as<float>() + k_cache.size(),
            k_flat.data_as<float>());
  std::copy(v_cache.data_as<float>(), v_cache.data_as<float>() + v_cache.size(),
            v_flat.data_as<float>());
  for (const auto& [name, array] : {std::pair<const char*, const NpyArray*>{"q", &q},
                                    {"k", &k},
                                    {"v", &v},
                                    {"cu_q", &cu_q},
                                    {"cu_k", &cu_k},
                                    {"used", &used},
                                    {"table", &table},
                                    {"kc", &k_cache},
                                    {"vc", &v_cache},
                                    {"kf", &k_flat},
                                    {"vf", &v_flat}}) {
    mha_tools::write_npy(path(name), *array);
  }
  const Result packed =
      mha_run({"--q", path("q"), "--k", path("k"), "--v", path("v"), "--cu-seqlens-q", path("cu_q"),
               "--cu-seqlens-k", path("cu_k"), "--causal", "bottom-right", "--out",
               path("out_packed"), "--lse", path("lse_packed")});
  ASSERT_EQ(packed.status, 0) << packed.err;
  const Result paged =
      mha_run({"--q", path("q"), "--k", path("kc"), "--v", path("vc"), "--cu-seqlens-q",
               path("cu_q"), "--seqused-k", path("used"), "--block-table", path("table"),
               "--causal", "bottom-right", "--out", path("out_paged"), "--lse", path("lse_paged")});
  ASSERT_EQ(paged.status, 0) << paged.err;
  const Result flat =
      mha_run({"--q", path("q"), "--k", path("kf"), "--v", path("vf"), "--cu-seqlens-q",
               path("cu_q"), "--seqused-k", path("used"), "--block-table", path("table"),
               "--block-size", "8", "--causal", "bottom-right", "--out", path("out_flat")});
  ASSERT_EQ(flat.status, 0) << flat.err;
  EXPECT_EQ(file_bytes(path("out_paged")), file_bytes(path("out_packed")));
  EXPECT_EQ(file_bytes(path("lse_paged")), file_bytes(path("lse_packed")));
  EXPECT_EQ(file_bytes(path("out_flat")), file_bytes(path("out_packed")));
  // NumPy's default integers: the table and the lengths as int64, in C and in
  // Fortran order, are converted (the table used to be read as if of rank 1).
  for (const bool fortran : {false, true}) {
    NpyArray table64(NpyDtype::I64, {batch, max_blocks}, fortran);
    NpyArray used64(NpyDtype::I64, {batch});
    for (int64_t b = 0; b < batch; ++b) {
      used64.set_from_double(b, static_cast<double>(lens_k[static_cast<size_t>(b)]));
      for (int64_t n = 0; n < max_blocks; ++n) {
        table64.set_from_double(table64.offset({b, n}),
                                static_cast<double>(table.data_as<int32_t>()[b * max_blocks + n]));
      }
    }
    mha_tools::write_npy(path("table64"), table64);
    mha_tools::write_npy(path("used64"), used64);
    const Result wide =
        mha_run({"--q", path("q"), "--k", path("kc"), "--v", path("vc"), "--cu-seqlens-q",
                 path("cu_q"), "--seqused-k", path("used64"), "--block-table", path("table64"),
                 "--causal", "bottom-right", "--out", path("out_wide")});
    ASSERT_EQ(wide.status, 0) << wide.err;
    EXPECT_EQ(file_bytes(path("out_wide")), file_bytes(path("out_packed")));
    table64.set_from_double(table64.offset({2, 3}), 4294967296.0);
    mha_tools::write_npy(path("table64"), table64);
    const Result huge = mha_run({"--q", path("q"), "--k", path("kc"), "--v", path("vc"),
                                 "--cu-seqlens-q", path("cu_q"), "--seqused-k", path("used64"),
                                 "--block-table", path("table64"), "--out", path("out_wide")});
    EXPECT_EQ(huge.status, 1);
    EXPECT_NE(huge.err.find("--block-table"), std::string::npos) << huge.err;
    EXPECT_NE(huge.err.find("at index [2, 3] does not fit in int32"), std::string::npos)
        << huge.err;
  }

  const std::string q_path = path("q"), kc = path("kc"), vc = path("vc"), o = path("o");
  const std::string cu = path("cu_q"), u = path("used"), t = path("table");
  EXPECT_EQ(mha_run({"--q", q_path, "--k", kc, "--v", vc, "--out", o, "--cu-seqlens-q", cu,
                     "--block-table", t})
                .status,
            2);  // no --seqused-k
  EXPECT_EQ(mha_run({"--q", q_path, "--k", kc, "--v", vc, "--out", o, "--cu-seqlens-q", cu,
                     "--seqused-k", u, "--block-table", t, "--cu-seqlens-k", path("cu_k")})
                .status,
            2);
  EXPECT_EQ(mha_run({"--q", q_path, "--k", path("k"), "--v", path("v"), "--out", o,
                     "--cu-seqlens-q", cu, "--cu-seqlens-k", path("cu_k"), "--block-size", "8"})
                .status,
            2);
  const Result no_size = mha_run({"--q", q_path, "--k", path("kf"), "--v", path("vf"), "--out", o,
                                  "--cu-seqlens-q", cu, "--seqused-k", u, "--block-table", t});
  EXPECT_EQ(no_size.status, 1);
  EXPECT_NE(no_size.err.find("--block-size"), std::string::npos) << no_size.err;
  EXPECT_NE(no_size.err.find("(not given)"), std::string::npos) << no_size.err;
  for (const char* size : {"0", "-8", "7"}) {  // not a positive divisor of the rows: named
    const Result wrong =
        mha_run({"--q", q_path, "--k", path("kf"), "--v", path("vf"), "--out", o, "--cu-seqlens-q",
                 cu, "--seqused-k", u, "--block-table", t, "--block-size", size});
    EXPECT_EQ(wrong.status, 1) << size;
    EXPECT_NE(wrong.err.find(std::string("(it is ") + size + ")"), std::string::npos) << wrong.err;
  }
  table.set_from_double(1, double(num_blocks));  // sequence 0's second block: past the cache
  mha_tools::write_npy(path("bad_table"), table);
  const Result bad = mha_run({"--q", q_path, "--k", kc, "--v", vc, "--out", o, "--cu-seqlens-q", cu,
                              "--seqused-k", u, "--block-table", path("bad_table")});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("block_table[0][1]"), std::string::npos) << bad.err;
}

// ---------------------------------------------------------------- pieces

TEST(ToolText, Escape) {
  using mha_tools::escape;
  EXPECT_EQ(escape("plain text, ü and € stay"), "plain text, ü and € stay");
  EXPECT_EQ(escape("\x1b[31mred\x1b[0m"), "\\x1b[31mred\\x1b[0m");
  EXPECT_EQ(escape("a\tb\nc\rd\x7f"), "a\\tb\\nc\\rd\\x7f");
  EXPECT_EQ(escape(std::string("nul\0!", 5)), "nul\\x00!");
  EXPECT_EQ(escape("\xc2\x9b"
                   "2J"),
            "\\xc2\\x9b2J");  // C1 CSI as UTF-8
  EXPECT_EQ(escape("\x9b"
                   "2J \xff \xc3"),
            "\\x9b2J \\xff \\xc3");                      // not UTF-8
  EXPECT_EQ(escape("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  const std::string once = escape("\x1b]2;title\x07");
  EXPECT_EQ(escape(once), once);
}

TEST(ToolText, FifoIsRefusedWithoutBlocking) {
  const std::string fifo =
      ::testing::TempDir() + "mha_tool_fifo_" + std::to_string(::getpid()) + ".npy";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  try {
    (void)mha_tools::read_npy(fifo);
    ADD_FAILURE() << "a FIFO was read";
  } catch (const mha_tools::NpyError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)mha_tools::read_small_file(fifo, 100), mha_tools::NpyError);
  ::unlink(fifo.c_str());
}

// Run by ctest with MHA_BACKEND=nonsense (tools.main.info_no_backend): the
// report is printed and the status is 1.
TEST(ToolMainNoBackend, InfoExitsOne) {
  const char* backend = std::getenv("MHA_BACKEND");
  if (backend == nullptr || std::string(backend) != "nonsense") {
    GTEST_SKIP() << "runs with MHA_BACKEND=nonsense";
  }
  const Result r = run(mha_tools::mha_info_main, "mha-info", {});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("selected backend: none: backend 'nonsense' is unknown"), std::string::npos)
      << r.out;
  const Result json = run(mha_tools::mha_info_main, "mha-info", {"--json"});
  EXPECT_EQ(json.status, 1);
  EXPECT_NE(json.out.find("\"selected\": null"), std::string::npos) << json.out;
}

}  // namespace
