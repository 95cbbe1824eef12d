// Build glue, not Backend logic: keeps the library loadable on glibc 2.28
// (the wheel's manylinux_2_28 tag) when it is compiled on a newer system.
//
// GCC 11+'s libstdc++ headers read glibc's `__libc_single_threaded`
// (GLIBC_2.32) wherever a std::shared_ptr or std::string changes a reference
// count, when the build machine's glibc has <sys/single_threaded.h>. Built on
// glibc 2.36 the library then needed GLIBC_2.32 and would not load on a
// manylinux_2_28 system. ringlet/distributed/_native.py compiles every source
// with -D__libc_single_threaded=ringlet_libc_single_threaded, and this file
// defines that variable as 0 ("there may be threads"): the headers then always
// take the atomic path, which is correct in any process (and what a
// multi-threaded process takes anyway).
extern "C" {
char ringlet_libc_single_threaded = 0;
}
