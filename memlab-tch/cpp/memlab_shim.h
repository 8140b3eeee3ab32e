// Declarations shared by memlab's C++ shim files.
#pragma once

#include <cstdint>

namespace memlab {

// The hook events are reported to: action code (see memlab-tch/src/events.rs),
// device (-1 = CPU), address, size. It must not throw.
using EventHook = void (*)(int32_t action, int32_t device, uint64_t address, uint64_t size);

// A malloc'd copy of `message`, for the Rust side to free with memlab_free_error.
char* error_copy(const char* message);

}  // namespace memlab
