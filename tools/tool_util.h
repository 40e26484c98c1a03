// Small helpers the command-line tools share: text made safe to print, an
// error line on stderr, MHA_VERBOSE, reading small regular files without
// blocking, and an index or shape as the library's messages write them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mha_tools {

// Text made safe to print on a terminal, on one line: tab, newline and
// carriage return as \t \n \r; other control characters (C0, DEL, the C1
// range U+0080..U+009F) and bytes that are not valid UTF-8 as \xNN.  Valid
// UTF-8 otherwise passes unchanged, and so does text that is already
// escaped (escape(escape(s)) == escape(s)).
std::string escape(std::string_view text);

// Prints "mha-run: <message>" on stderr, the message escaped (escape()).
void print_error(const std::string& message);

// MHA_VERBOSE set to a level >= 1 (the library's own verbose switch).
bool verbose();

// This process is one of mpirun's ranks other than 0 (the launchers' rank
// variables: Open MPI's OMPI_COMM_WORLD_RANK, PMIx's PMIX_RANK, MPICH's
// PMI_RANK).  Errors in the command line, the same on every rank, are then
// left to rank 0 to print, before MPI is even started.
bool secondary_mpi_rank();

// The whole content of a small regular file.  The file is opened with
// O_NONBLOCK and checked to be a regular file before anything is read (a
// FIFO is refused instead of blocking).  Throws NpyError ("cannot open: ...",
// "not a regular file", "larger than N bytes") with a message that does not
// name the path.
std::string read_small_file(const std::string& path, std::size_t limit);

// "[1, 3]", as the library writes a shape or an index in its messages.
std::string bracketed(const std::vector<int64_t>& values);

}  // namespace mha_tools
